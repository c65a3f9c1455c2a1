"""Checkpoint tensor names <-> the model's parameter names, by transformers' own key mapping.

Some families' modules are named differently from their checkpoints (GPT-NeoX's head is
`lm_head` in the module, `embed_out` in every published file), and some checkpoints were saved
from the base model alone (no `transformer.` / `model.` prefix). transformers renames keys as it
loads (`conversion_mapping`) and renames them back as it saves; tierlm reads and writes tensors
one at a time, so it asks the same mapping which file tensor is which parameter, and saves under
the family's own names. Mappings that merge or split tensors (per-expert weights stacked into one)
are not renamings; a checkpoint that needs one is refused here with the reason.
"""
from __future__ import annotations

from collections.abc import Iterable


def _transforms(model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming
    ts = get_model_conversion_mapping(model)
    return [t for t in ts if isinstance(t, WeightRenaming)], [t for t in ts if not isinstance(t, WeightRenaming)]


def _converted(key: str, converters) -> bool:
    from transformers.core_model_loading import apply_converters
    return apply_converters(key, converters)[1] is not None


def model_to_checkpoint(model, checkpoint: Iterable[str], wanted: Iterable[str], where="the checkpoint") -> dict[str, str]:
    """{parameter name: checkpoint tensor name} for each of `wanted` found in `checkpoint`'s names
    (a parameter the file lacks is left out; the caller names it). ValueError where the file's
    tensors need merging into the model's (stacked experts)."""
    from transformers.core_model_loading import apply_renamings
    renames, converters = _transforms(model)
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
        if converters and _converted(apply_renamings(ck, renames), converters):
            raise ValueError(f"{where}: tensor {ck!r} must be merged with others into one parameter of "
                             f"{type(model).__name__} (per-expert weights stacked), which tierlm does not do "
                             "yet")
        name = apply_renamings(ck, renames)
        if name not in wanted and name not in alias and prefix and f"{prefix}.{name}" in known:
            name = f"{prefix}.{name}"  # saved from the base model alone
        if name in wanted and name not in out:
            out[name] = ck
        elif alias.get(name) in wanted:
            by_alias.setdefault(alias[name], ck)
    for name, ck in by_alias.items():
        out.setdefault(name, ck)
    return out


def checkpoint_names(model, names: Iterable[str]) -> dict[str, str]:
    """{parameter name: the family's own file name} (what save_pretrained writes), the mapping
    built once for all of them."""
    from transformers.core_model_loading import apply_renamings
    renames, _ = _transforms(model)
    back = [r.reverse_transform() for r in reversed(renames)]
    return {n: apply_renamings(n, back) for n in names}
