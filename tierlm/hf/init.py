"""Create a randomly initialised HF model directory without ever holding the whole model.

The model is built on the `meta` device (shapes only), then materialised one piece at a time (a
decoder layer, the embedding, the final norm, the head), initialised with the model's own
`_init_weights`, streamed to safetensors and dropped back to meta. Peak memory is the largest
piece (usually the embedding), so a 3B model is created inside a 4 GiB budget.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers import initialization as hf_init

from tierlm.hf import fields
from tierlm.hf.stacked import file_tensors, file_writes
from tierlm.hf.presets import dtype_name
from tierlm.hf.safetensors_io import SafetensorsWriter
from tierlm.hf.tokenizer import make_tokenizer, special_token_ids


SMALL = 1 << 16  # elements: a constant fill this small is made for real while the model is built


def _size_numel(args) -> int:
    size = args[0] if args and isinstance(args[0], (tuple, list, torch.Size)) else args
    n = 1
    for d in size:
        if not isinstance(d, int):
            return SMALL + 1  # not a plain size: leave it to the meta device
        n *= d
    return n


class _ConstantsOnCPU(torch.overrides.TorchFunctionMode):
    """Inside `torch.device("meta")`: tensors a constructor makes from data (torch.tensor) or small
    constant fills stay real, on the CPU. Their values are the module's own and `_init_weights` may
    never rewrite them (xIELU's alpha_p, alpha_n, beta and eps in Apertus's MLP): on meta they were
    lost, and `to_empty` gave them whatever the allocator's memory held - a different model each run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is None:
            if func in (torch.tensor, torch.as_tensor, torch.scalar_tensor):
                kwargs["device"] = "cpu"
            elif func in (torch.ones, torch.zeros) and _size_numel(args) <= SMALL:
                kwargs["device"] = "cpu"
            elif func is torch.full and _size_numel(args[:1]) <= SMALL:
                kwargs["device"] = "cpu"
        if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].is_meta \
                and not args[0].is_meta:
            # the family's init computing a constant kept real from numbers drawn on meta (Zamba's
            # dt_proj_bias): nothing to copy yet; the piece's own init sets it when it is written
            return args[0]
        if func in (torch.cat, torch.stack) and args and isinstance(args[0], (list, tuple)):
            # a constant kept real joined to a computed one left on meta (Gemma 4's proportional
            # rotary: arange's frequencies beside zeros): the result is meta, as the module's would be
            parts = args[0]
            if any(isinstance(t, torch.Tensor) and t.is_meta for t in parts):
                args = ([t.to("meta") if isinstance(t, torch.Tensor) else t for t in parts], *args[1:])
        return func(*args, **kwargs)


def _materialise(piece: nn.Module) -> None:
    """Give the piece's meta parameters and buffers CPU memory, keeping those already real (one
    tensor shared by two modules stays one)."""
    made: dict[int, torch.Tensor] = {}
    for m in piece.modules():
        for table in (m._parameters, m._buffers):
            for n, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    # NaN until initialised: what the family's _init_weights leaves shows (_init_rest)
                    real = torch.full_like(t, float("nan"), device="cpu") if t.is_floating_point() \
                        else torch.empty_like(t, device="cpu")
                    made[id(t)] = nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else real
                table[n] = made[id(t)]


def _has_saved_state(mod: nn.Module) -> bool:
    bufs = [n for n, b in mod._buffers.items() if b is not None and n not in mod._non_persistent_buffers_set]
    return any(p is not None for p in mod._parameters.values()) or bool(bufs)


def _pieces(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) units to materialise one at a time, in state_dict order.

    Each element of a ModuleList is one unit (a decoder layer); elsewhere the first module on each
    path that owns saved state is one, with its whole subtree. Modules holding only non-persistent
    buffers (rotary inv_freq) are skipped: nothing of theirs is saved.
    """
    out = []

    def walk(prefix: str, mod: nn.Module) -> None:
        if isinstance(mod, nn.ModuleList):
            out.extend((prefix + name, child) for name, child in mod.named_children())
            return
        if _has_saved_state(mod):
            out.append((prefix.rstrip("."), mod))
            return
        for name, child in mod.named_children():
            walk(prefix + name + ".", child)

    walk("", model)
    return out


def _saved_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict entries that go to disk: a tensor shared by several names (tied embeddings) is saved
    once, under the first name, as save_pretrained does."""
    seen, keep = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            keep[name] = t
    return keep


@torch.no_grad()
def _init_piece(model, piece: nn.Module) -> None:
    # Children before parents, as initialize_weights() does: GPT-2's attention/MLP re-draw their
    # c_proj after the generic Conv1D init with a depth-scaled std.
    owner = _initialisers(model)
    with hf_init.guard_torch_init_functions():
        for sub in reversed(list(piece.modules())):
            owner.get(id(sub), model)._init_weights(sub)
    _init_rest(model, piece)


def _initialisers(model) -> dict[int, nn.Module]:
    """Each module's nearest transformers model above it (itself, where it is one), whose
    `_init_weights` draws it, as transformers' own initialisation dispatches: xLSTM's base model
    draws its embedding through `self.embeddings`, which the causal LM around it has not."""
    from transformers import PreTrainedModel
    owner: dict[int, nn.Module] = {}
    for m in model.modules():  # parents before children: the nearest wins
        if isinstance(m, PreTrainedModel):
            owner.update((id(sub), m) for sub in m.modules())
    return owner


@torch.no_grad()
def _init_rest(model, piece: nn.Module) -> None:
    """Weights the family's `_init_weights` does not draw, because the module draws them in its own
    constructor (OpenAI GPT's Conv1D), which ran on `meta` here: drawn as that convention does,
    normal with the config's initializer_range (matrices), zeros (vectors). Without this they were
    whatever the allocator held, NaN included."""
    std = getattr(model.config, "initializer_range", None) or 0.02
    for t in list(piece.parameters()) + list(piece.buffers()):
        if t.is_floating_point() and t.numel() and torch.isnan(t).all():
            if t.dim() >= 2:
                t.normal_(0.0, std)
            else:
                t.zero_()


def _write_piece(model, piece: nn.Module, prefix: str, saved: dict, writer: SafetensorsWriter) -> None:
    # A function of its own so no loop variable keeps the last tensor alive after the piece is freed.
    _materialise(piece)
    _init_piece(model, piece)
    for k, t in piece.state_dict(prefix=prefix).items():
        if k in saved:
            for f, ft, row in file_writes(model, k, t):
                writer.write(f, ft, row)
    piece.to_empty(device="meta")


def file_layout(model, saved: dict | None = None) -> dict[str, dict[str, tuple]]:
    """parameter -> {file tensor: shape} of `model` (on meta will do) as the family's own
    save_pretrained writes it: its file names (GPT-NeoX's head is `embed_out` in its files), experts
    split, heads padded (Inkling 2's, to vocab_size)."""
    saved = _saved_tensors(model) if saved is None else saved
    return {n: file_tensors(model, n, t.shape, t.dtype) for n, t in saved.items()}


def init_model(out_dir: str | os.PathLike, config, seed: int = 0, dtype: str | torch.dtype | None = None,
               tokenizer_text: list[str] | None = None, max_shard_bytes: int | str = "2GiB",
               tokenizer: bool = True, overwrite: bool = False) -> Path:
    """Write config.json, generation_config.json, safetensors weights and a tokenizer to out_dir.

    `dtype` defaults to config.dtype, else float32. With `tokenizer`, a byte-level tokenizer (BPE
    trained on `tokenizer_text` files when given) is written and its special-token ids go into the
    config. Returns out_dir.
    """
    out = Path(out_dir)
    if (out / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{out} already holds a model (config.json); pick a new directory or pass "
                              "overwrite=True")
    out.mkdir(parents=True, exist_ok=True)
    # Overwriting: drop the old config first, so until this finishes the directory reads as unfinished
    # rather than as the old model's config over new weights.
    (out / "config.json").unlink(missing_ok=True)
    config = copy.deepcopy(config)
    dtype = getattr(torch, dtype_name(dtype or getattr(config, "dtype", None) or "float32"))
    config.dtype = dtype_name(dtype)
    gen_kw = {}
    if tokenizer:
        max_len = fields.get(config, "max_positions")
        tok = make_tokenizer(out, tokenizer_text, vocab_size=config.vocab_size, model_max_length=max_len)
        ids = special_token_ids(tok)
        config.bos_token_id, config.eos_token_id = ids["bos_token_id"], ids["eos_token_id"]
        # pad stays out of config.json on purpose: Llama-family models turn config.pad_token_id into
        # nn.Embedding(padding_idx=...), which zeroes that row and freezes its gradient - and our pad
        # is the end-of-text token. Generation gets it from generation_config instead.
        try:
            config.pad_token_id = None
        except Exception:  # noqa: BLE001 -- a family whose config requires one (ModernBERT's decoder)
            config.pad_token_id = ids["pad_token_id"]
        gen_kw = dict(bos_token_id=ids["bos_token_id"], pad_token_id=ids["pad_token_id"],
                      eos_token_id=[ids["eos_token_id"], ids["im_end_token_id"]])

    with torch.random.fork_rng(devices=[]), torch.device("meta"), _ConstantsOnCPU():
        model = AutoModelForCausalLM.from_config(config)  # a small real tensor may draw numbers
    model.to(dtype)  # on meta: free, and to_empty() below then allocates each piece in this dtype
    model.eval()
    saved = _saved_tensors(model)
    files = file_layout(model, saved)
    # (a fused tensor several parameters are cut from is declared once: hf.split_tensors)
    specs = {f: (f, t.dtype, shape) for n, t in saved.items() for f, shape in files[n].items()}
    writer = SafetensorsWriter(out, list(specs.values()), max_shard_bytes)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for name, piece in _pieces(model):
                prefix = name + "." if name else ""
                keys = [prefix + k for k in piece.state_dict(keep_vars=True)]
                if not any(k in saved for k in keys):
                    continue  # e.g. a tied lm_head: its weight is the embedding, already written
                _write_piece(model, piece, prefix, saved, writer)
    except BaseException:
        writer.abort()
        raise
    writer.close()

    # Config last: a directory without config.json is plainly unfinished.
    if gen_kw:
        GenerationConfig(**gen_kw).save_pretrained(out)
    config.save_pretrained(out)
    return out
