"""RSS of the libraries alone, measured by running a tiny copy of the model's family: what every
memory budget counts from (`--cpu-mem` covers what grows with the model, nothing of this)."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from ..rss import current_rss, trim
from .fields import shrunk
from .structure import cast, causal_lm


def library_baseline(config, dtype: torch.dtype = torch.bfloat16, device=None,
                     warm=None) -> int:
    """RSS of the libraries alone: torch, transformers, this architecture's model code, and the
    code pages of the kernels it runs (a tiny model of the same architecture runs one forward and
    backward in `dtype` to touch them; on `device`, so a GPU's driver context and libraries are
    counted too). `--cpu-mem` counts everything beyond this; none of it grows with the model.

    warm: on a GPU, a function run before measuring. CUDA loads each kernel's module into host memory
    on its first use, and which kernels run depends on the shapes: the engine passes one that runs
    a decoder layer of the real width and the head's loss at its micro-batch
    (`tierlm.engine.baseline.warm_kernels`), so that what a step loads is counted here and not
    against `--cpu-mem`."""
    tiny = shrunk(config)

    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    device = torch.device(device or "cpu")
    m = cast(causal_lm(AutoModelForCausalLM.from_config(tiny)), dtype, device)
    ids = torch.randint(0, tiny.vocab_size, (1, 8)).to(device)
    m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    del m
    if device.type == "cuda" and warm is not None:
        warm()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    torch.random.set_rng_state(state)
    trim()
    return current_rss()
