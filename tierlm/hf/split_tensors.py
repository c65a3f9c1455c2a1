"""Parameters cut from one checkpoint tensor: a fused projection the family's modules keep apart.

Some checkpoints fuse what the model's modules keep as separate parameters: Sarvam-MoE's
`query_key_value` rows are the q, k and v projections; LARA's `linear_attn.in_proj` is four. The
family's conversion (a `WeightConverter` with one source and several targets, by `Split` or `Chunk`
along a dimension) cuts the file tensor into the parameters as `from_pretrained` loads it, and
`save_pretrained` concatenates them back. tierlm reads and writes a parameter at a time, so each
parameter is its slice of the file tensor: read from its rows alone, and written into them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    """Parameter `name` is rows `start:stop` (along `dim`) of file tensor `file`, which `size` rows
    make whole (the parameters of `group`, in order)."""
    name: str
    file: str
    dim: int
    start: int
    stop: int
    size: int
    group: tuple[str, ...]

    def check(self, file_shape, shape) -> None:
        """That the file tensor is what the model's config makes of it (the group's rows, the same
        other dimensions as this parameter)."""
        want = list(shape)
        want[self.dim] = self.size
        if list(file_shape) != want:
            raise ValueError(f"the checkpoint's {self.file!r} has shape {tuple(file_shape)} where the model's "
                             f"config makes {tuple(want)} (its {', '.join(self.group)}); does config.json belong "
                             "to these weights?")


def _tensor(model, name: str):
    """A parameter or buffer of the model by name (None where it has none)."""
    mod, _, attr = name.rpartition(".")
    try:
        return getattr(model.get_submodule(mod), attr, None)
    except AttributeError:
        return None


def _size(model, name: str, dim: int) -> int:
    """Parameter `name`'s size along `dim`: its tensor's, or where a module keeps its weight in
    another form (the inference engine's quantised linear maps), the linear map's own sizes."""
    t = _tensor(model, name)
    if isinstance(t, torch.Tensor):
        return t.shape[dim]
    mod, _, attr = name.rpartition(".")
    m = model.get_submodule(mod)
    sizes = {("weight", 0): "out_features", ("weight", 1): "in_features", ("bias", 0): "out_features"}
    f = sizes.get((attr, dim))
    if f is None or not isinstance(getattr(m, f, None), int):
        raise ValueError(f"{name}: tierlm cannot tell its size along dimension {dim}, which cutting the "
                         "checkpoint's fused tensor into it needs")
    return getattr(m, f)


def _cuts(conv) -> int | None:
    """The dimension a one-to-many conversion cuts its one file tensor along, or None where it is
    not such a cut (stacking experts, or an operation tierlm does not run a slice at a time)."""
    from transformers.core_model_loading import Chunk, Split
    if len(conv.target_patterns) < 2 or len(conv.source_patterns) != 1 or len(conv.operations) != 1:
        return None
    op = conv.operations[0]
    if isinstance(op, Split) or (isinstance(op, Chunk) and op.num_shards_attribute is None):
        return op.dim
    return None


def is_cut(conv) -> bool:
    return len(conv.target_patterns) > 1 and len(conv.source_patterns) == 1


def parts(model, file: str, target: str, conv) -> dict[str, Part]:
    """{parameter: Part} of the parameters conversion `conv` cuts file tensor `file` into, where
    `target` is the first of them (as transformers names it: the others replace the conversion's
    first target pattern with theirs). Their sizes along the cut are the model's own parameters'."""
    dim = _cuts(conv)
    if dim is None:
        raise ValueError(f"{type(model).__name__}: the family's conversion makes {list(conv.target_patterns)} of "
                         f"{file!r} by {[type(o).__name__ for o in conv.operations]}, which tierlm does not run "
                         "a parameter at a time")
    names = tuple(target.replace(conv.target_patterns[0], t) for t in conv.target_patterns)
    sizes = [_size(model, n, dim) for n in names]
    out, start = {}, 0
    for n, s in zip(names, sizes):
        out[n] = Part(n, file, dim, start, start + s, sum(sizes), names)
        start += s
    return out


def read(st, part: Part, out: torch.Tensor | None = None) -> torch.Tensor:
    """The parameter's slice of the file tensor (into `out`, cast to its dtype, where given)."""
    dt, shape = st.info(part.file)
    want = list(shape)
    want[part.dim] = part.stop - part.start
    if out is not None:
        part.check(shape, out.shape)
    if part.dim == 0:  # rows: one contiguous byte range of the file tensor
        t = st.read_rows(part.file, part.start, part.stop)
    else:
        t = st.read(part.file).narrow(part.dim, part.start, part.stop - part.start)
    if out is None:
        return t.contiguous()
    return out.copy_(t.view(want))


def transforms(model) -> tuple[list, list]:
    """The family's conversions of checkpoint keys: (renamings, conversions of tensors), kept on
    the model (a save asks once a parameter)."""
    got = getattr(model, "_tierlm_transforms", None)
    if got is None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
        ts = get_model_conversion_mapping(model)
        got = [t for t in ts if isinstance(t, WeightRenaming)], [t for t in ts if not isinstance(t, WeightRenaming)]
        model._tierlm_transforms = got
    return got


def converted(key: str, converters):
    """(the parameter the family's conversions make of file tensor `key`, the conversion, the
    source pattern it matched), or None where no conversion takes it."""
    from transformers.core_model_loading import apply_converters
    for conv in converters:
        target, pattern = apply_converters(key, [conv])
        if pattern is not None:
            return target, conv, pattern
    return None


def part_of(model, name: str) -> Part | None:
    """Parameter `name`'s slice of the file tensor the family's save fuses it into, or None where
    it is saved as a tensor of its own (or stacked with others: stacked.py)."""
    from transformers.core_model_loading import apply_renamings, revert_weight_conversion
    renames, converters = transforms(model)
    if not any(is_cut(c) for c in converters):
        return None
    p = _tensor(model, name)
    if p is None:
        return None
    files = list(revert_weight_conversion(model, {name: torch.empty(tuple(p.shape), device="meta")}))
    if len(files) != 1:
        return None
    hit = converted(apply_renamings(files[0], renames), converters)
    if hit is None or not is_cut(hit[1]):
        return None
    target, conv, _ = hit
    prefix = getattr(model, "base_model_prefix", "") or ""
    got = parts(model, files[0], target, conv)
    return got.get(name) or got.get(name[len(prefix) + 1:] if name.startswith(prefix + ".") else name)
