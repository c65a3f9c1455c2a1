"""Parameters made from several checkpoint tensors: a mixture of experts' stacked expert weights.

transformers builds a mixture of experts' weights as one [experts, ...] parameter per projection
(Mixtral's `mlp.experts.gate_up_proj`), while the published files keep one tensor per expert and
projection (`block_sparse_moe.experts.3.w1.weight`, `...w3.weight`). The family's own conversion
(a `WeightConverter`: stack the experts, concatenate gate and up) makes the parameter as
`from_pretrained` loads it; `save_pretrained` runs it backwards. tierlm reads and writes a tensor at
a time, so it runs the same conversion one expert at a time: an expert's slice is made from that
expert's file tensors alone, and a parameter is never held twice over while it is assembled.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch


class Stacked:
    """A parameter the family's conversion makes from file tensors, one group per expert."""

    def __init__(self, name: str, converter, sources: dict[str, list[str]], model=None):
        from transformers.core_model_loading import dot_natural_key

        # model: what some conversions read (Inkling 2's unpadding of its head: the config's
        # vocabulary and the parameter's dtype), as from_pretrained hands it to them
        self.name, self.converter, self.model = name, converter, model
        # the file tensors of each source pattern, in expert order (experts.10 after experts.9)
        self.sources = {pat: sorted(names, key=dot_natural_key) for pat, names in sources.items()}
        counts = {len(v) for v in self.sources.values()}
        if len(counts) != 1:
            raise ValueError(f"{name}: the checkpoint holds {sorted(counts)} tensors for its different parts; "
                             "each expert needs one of each")
        self.experts = counts.pop()

    def files(self) -> list[str]:
        return [n for names in self.sources.values() for n in names]

    def _convert(self, tensors: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        conv = copy.deepcopy(self.converter)
        for pat, ts in tensors.items():
            for n, t in zip(self.sources[pat], ts):
                conv.add_tensor(self.name, n, pat, t)
        out = conv.convert(self.name, model=self.model, config=getattr(self.model, "config", None))
        if len(out) != 1:
            raise ValueError(f"{self.name}: the family's conversion made {sorted(out)} of it; tierlm expects "
                             "the one parameter")
        return next(iter(out.values()))

    def expert(self, read: Callable[[str], torch.Tensor], e: int) -> torch.Tensor:
        """Expert `e`'s slice of the parameter, made from its own file tensors: [1, ...]."""
        return self._convert({pat: [read(names[e])] for pat, names in self.sources.items()})

    def whole(self) -> bool:
        """A conversion of single tensors into one (OLMo-Hybrid's q, k and v convolutions concatenated
        into one conv1d weight), not of experts: made in one piece."""
        return self.experts == 1

    def read_into(self, read: Callable[[str], torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """The whole parameter into `out` ([experts, ...]), an expert at a time (cast to out's dtype)."""
        if self.whole() and out.shape[0] != 1:
            t = self._convert({pat: [read(names[0])] for pat, names in self.sources.items()})
            if tuple(t.shape) != tuple(out.shape):
                raise ValueError(f"{self.name}: the checkpoint's tensors make shape {tuple(t.shape)} where the "
                                 f"model's config makes {tuple(out.shape)}; does config.json belong to these weights?")
            return out.copy_(t)
        if out.shape[0] != self.experts:
            raise ValueError(f"{self.name}: the checkpoint holds {self.experts} experts where the model's config "
                             f"makes {out.shape[0]}; does config.json belong to these weights?")
        for e in range(self.experts):
            t = self.expert(read, e)
            if tuple(t.shape[1:]) != tuple(out.shape[1:]) or t.shape[0] != 1:
                raise ValueError(f"{self.name}: the checkpoint's expert {e} makes a slice of shape "
                                 f"{tuple(t.shape)} where the model's config makes {(1, *out.shape[1:])}; does "
                                 "config.json belong to these weights?")
            out[e].copy_(t[0])
        return out


def read_param(st, entry, out: torch.Tensor | None = None) -> torch.Tensor:
    """One parameter from the checkpoint `st` (a SafetensorsDir): a file tensor by name, a stacked
    one made from its experts' tensors, or a slice of a fused one (split_tensors.Part). Into `out`
    (cast to its dtype) where given; else in the file's dtype."""
    from . import split_tensors
    if isinstance(entry, split_tensors.Part):
        return split_tensors.read(st, entry, out)
    if isinstance(entry, Stacked):
        if out is None:  # the slice's shape from the conversion run on meta tensors: nothing read twice
            info = {p: st.info(names[0]) for p, names in entry.sources.items()}
            dt = next(iter(info.values()))[0]
            shape = entry._convert({p: [torch.empty(sh, dtype=d, device="meta")] for p, (d, sh) in info.items()}).shape
            out = torch.empty(shape if entry.whole() else (entry.experts, *shape[1:]), dtype=dt)
        return entry.read_into(st.read, out)
    if out is None:
        return st.read(entry)
    dt, shape = st.info(entry)
    if out.numel() != torch.Size(shape).numel():
        raise ValueError(f"the checkpoint's {entry!r} has shape {tuple(shape)} where the model's config makes "
                         f"{tuple(out.shape)}; does config.json belong to these weights?")
    if dt == out.dtype and out.is_contiguous():
        st.read(entry, out)
    else:
        out.copy_(st.read(entry).view(out.shape))
    return out


def file_tensors(model, name: str, shape, dtype: torch.dtype) -> dict[str, tuple]:
    """{file tensor name: shape} the family's own save writes for parameter `name` (one, under its
    file name; one per expert and part where the family stacks experts; the whole fused tensor
    where the parameter is a slice of one, the same for each parameter of it: declare it once)."""
    from transformers.core_model_loading import revert_weight_conversion

    from .split_tensors import part_of
    part = part_of(model, name)
    if part is not None:
        whole = list(shape)
        whole[part.dim] = part.size
        return {part.file: tuple(whole)}
    out = revert_weight_conversion(model, {name: torch.empty(tuple(shape), dtype=dtype, device="meta")})
    return {k: tuple(v.shape) for k, v in out.items()}


def file_writes(model, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor, int | None]]:
    """[(file tensor name, tensor, first row)] of parameter `name` as the family's own save writes
    it: whole tensors (first row None), or the parameter's rows of a fused one."""
    from transformers.core_model_loading import revert_weight_conversion

    from .split_tensors import part_of
    part = part_of(model, name)
    if part is not None:
        if part.dim != 0:
            raise ValueError(f"{name}: the family's save concatenates it with {', '.join(part.group)} along "
                             f"dimension {part.dim}, which tierlm does not write a parameter at a time")
        return [(part.file, t.contiguous(), part.start)]
    return [(k, v.contiguous(), None) for k, v in revert_weight_conversion(model, {name: t}).items()]
