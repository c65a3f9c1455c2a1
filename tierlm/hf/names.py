"""Checkpoint tensor names <-> the model's parameter names, by transformers' own key mapping.

Some families' modules are named differently from their checkpoints (GPT-NeoX's head is
`lm_head` in the module, `embed_out` in every published file), and some checkpoints were saved
from the base model alone (no `transformer.` / `model.` prefix). transformers renames keys as it
loads (`conversion_mapping`) and renames them back as it saves; tierlm reads and writes tensors
one at a time, so it asks the same mapping which file tensor is which parameter, and saves under
the family's own names. Mappings that merge tensors (a mixture of experts' per-expert weights,
stacked into one parameter) are the family's conversions, run an expert at a time (`stacked.py`);
those that cut one file tensor into several parameters are read a slice at a time (`split_tensors.py`).
"""
from __future__ import annotations

from collections.abc import Iterable

from .split_tensors import Part, converted as _converted, is_cut, parts, transforms as _transforms
from .stacked import Stacked


def _with_prefix(name: str, known: set[str], prefix: str) -> str:
    """`name`, or under the base model's prefix where only that is the model's (a checkpoint saved
    from the base model alone)."""
    if name not in known and prefix and f"{prefix}.{name}" in known:
        return f"{prefix}.{name}"
    return name


def model_to_checkpoint(model, checkpoint: Iterable[str], wanted: Iterable[str],
                        where="the checkpoint") -> dict[str, str | Stacked | Part]:
    """{parameter name: checkpoint tensor name, the `Stacked` experts it is made from, or the `Part`
    of a file tensor it is cut from} for each of
    `wanted` found in `checkpoint`'s names (a parameter the file lacks is left out; the caller
    names it)."""
    from transformers.core_model_loading import apply_renamings
    renames, converters = _transforms(model)
    stacked: dict[str, tuple] = {}
    wanted = set(wanted)
    prefix = getattr(model, "base_model_prefix", "") or ""
    # A tied weight has one canonical name (the first, as named_parameters() gives it: the
    # embedding) and others (the head). Files normally hold the canonical one; some hold only the
    # head's copy, which transformers also loads as the tied weight, so it is taken where the
    # canonical name is missing.
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias[n] = first[id(p)]
        else:
            first[id(p)] = n
    known = wanted | alias.keys()
    out: dict[str, str] = {}
    by_alias: dict[str, str] = {}
    for ck in checkpoint:
        hit = _converted(apply_renamings(ck, renames), converters) if converters else None
        if hit is not None:
            target, conv, pattern = hit
            if target not in wanted and prefix and f"{prefix}.{target}" in wanted:
                target = f"{prefix}.{target}"
            if is_cut(conv):  # one file tensor, several parameters: each reads its slice (split_tensors)
                if target in wanted or any(n in wanted for n in (target.replace(conv.target_patterns[0], t)
                                                                 for t in conv.target_patterns)):
                    out.update({n: p for n, p in parts(model, ck, target, conv).items() if n in wanted})
                continue
            if target in wanted:
                stacked.setdefault(target, (conv, {}))[1].setdefault(pattern, []).append(ck)
            continue
        name = _with_prefix(apply_renamings(ck, renames), known, prefix)
        if name not in known and _with_prefix(ck, known, prefix) in known:
            # a renaming meant for other tensors matched this one (DeepSeek-V4's `.norm.` -> `.kv_norm.`
            # meets the final `model.norm`): transformers keeps such a key as it is, and so do we
            name = _with_prefix(ck, known, prefix)
        if name in wanted and name not in out:
            out[name] = ck
        elif alias.get(name) in wanted:
            by_alias.setdefault(alias[name], ck)
    for name, ck in by_alias.items():
        out.setdefault(name, ck)
    for name, (conv, sources) in stacked.items():
        if set(sources) != set(conv.source_patterns):
            missing = sorted(set(conv.source_patterns) - set(sources))
            raise ValueError(f"{where}: {name} is made from tensors matching {conv.source_patterns}, and the "
                             f"checkpoint has none matching {missing}; is it complete?")
        out[name] = Stacked(name, conv, sources, model)
    return out


def saved_buffers(model) -> dict[str, object]:
    """{name: buffer} of the persistent buffers a checkpoint holds beside the parameters (DeepSeek-V3's
    router correction bias), under the name state_dict() gives them."""
    params = {id(p) for p in model.parameters()}
    return {n: b for n, b in model.state_dict(keep_vars=True).items() if id(b) not in params}


def load_buffers(model, st, where: str) -> None:
    """Persistent buffers take the checkpoint's values where it holds them (the model's constructor
    made the rest: a checkpoint saved without them gets what from_pretrained would give)."""
    import torch

    bufs = saved_buffers(model)
    if not bufs:
        return
    in_file = model_to_checkpoint(model, st.names(), bufs, where=where)
    with torch.no_grad():
        for n, ck in in_file.items():
            if isinstance(ck, str):
                b = bufs[n]
                t = st.read(ck)
                if t.numel() != b.numel():
                    raise ValueError(f"{where}: the checkpoint's {ck!r} has shape {tuple(t.shape)} where the "
                                     f"model's config makes {tuple(b.shape)}; does config.json belong to these weights?")
                b.copy_(t.view(b.shape))
