"""Which device a verb computes on (`--device`), and a model's buffers moved there.

Shared by fine-tuning (tierlm.engine) and inference (tierlm.infer), which are independent of each
other, so it lives below both. The buffers are transformers' knowledge: its rotary embeddings keep a
copy of their frequencies as a plain attribute beside the registered buffer.
"""
from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """auto: the GPU where PyTorch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu or cuda (cuda:N); got {name!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is "
                             f"False; a CPU-only build of torch?); use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) are visible")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"--device must be auto, cpu or cuda (cuda:N); got {name!r}")
    return dev


def move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers (rotary frequencies) to the compute device; parameters arrive per block."""
    if device.type == "cpu":
        return
    for mod in model.modules():
        for k, b in mod._buffers.items():
            if b is not None:
                mod._buffers[k] = b.to(device)
        # transformers' rotary embeddings keep a copy of the frequencies as a plain attribute
        for k, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.device.type == "cpu" \
                    and k not in mod._buffers and k not in mod._parameters and not k.startswith("_"):
                setattr(mod, k, v.to(device))
