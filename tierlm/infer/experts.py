"""A mixture of experts' streamed experts: read from the store only when the router picks them,
kept in an expert cache in RAM.

transformers builds a mixture of experts' weights as stacked [experts, ...] parameters of an
experts module (Mixtral's `mlp.experts`), whose forward takes the hidden states and each token's
chosen experts. Of a streamed layer only what every token needs (attention, norms, router, shared
experts) streams with the layer; each stacked parameter is stored one expert at a time, and the
module's forward sees an `ExpertSlices` in its place: indexed by an expert, it gives that expert's
slice from the cache. A hook before the module's forward starts reading the step's missing experts
(all of them at once, in parallel) into cache slots; a hook after it unpins them. The module runs
an experts implementation that indexes only the experts it routed to, one at a time in ascending
order (`expert_rows.py`), so a batch reads each routed expert once per step whatever the number of
its tokens. Misses are issued in that order and each is waited for only when the loop reaches it:
the experts already in RAM, and the misses that have landed, compute while the later reads are on
the drive (the order of the sums, hence the bits, is the loop's either way).

Which experts stay is the cache policy's choice (`least recently used` or `least frequently used`,
counts halved every `decay` requests so that the counts follow a drifting routing); it changes what
is read, never what is computed: the bits are the same under any policy and any cache size.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..hf.structure import experts_modules
from ..storage.aligned import aligned_empty, round_up
from .quant import QLinear, int4_group_for, qproduct, torch_int4_fits

POLICIES = ("lfu", "lru")


@dataclass
class MoELayer:
    """A decoder layer's experts modules: (qualified name, module, its stacked parameters)."""
    modules: list
    experts: int

    def names(self) -> list[str]:
        return [f"{q}.{a}" for q, _, attrs in self.modules for a in attrs]


def find_moe(model: nn.Module, blocks) -> dict[int, MoELayer]:
    """block index -> its experts, for each decoder layer that has any."""
    qual = {id(m): n for n, m in model.named_modules()}
    out = {}
    for b in blocks:
        if b.kind != "layer":
            continue
        mods = [(qual[id(m)], m, attrs) for _, m, attrs in experts_modules(b.module)]
        if mods:
            out[b.index] = MoELayer(mods, max(m.num_experts for _, m, _ in mods))
    return out


def unrouted_params(moe: dict[int, MoELayer], config) -> int:
    """Parameters of the experts a token is not routed to (what a token does not multiply): each
    layer's stacked experts but `experts per token` of them."""
    from ..hf.fields import get

    k = get(config, "experts_per_token")
    if not moe or not k:
        return 0
    return sum(mod._parameters[a].numel() * (m.experts - k) // m.experts
               for m in moe.values() for _, mod, attrs in m.modules for a in attrs)


def expert_key(name: str, e: int) -> str:
    """The store key of expert e's slice of stacked parameter `name`."""
    return f"{name}#e{e}"


@dataclass
class Part:
    """One tensor of an expert in the store and in a cache slot: a stacked parameter's slice as it
    is, or the quantised matrix's packed weights or scales."""
    attr: str
    kind: str           # "" | "qweight" | "scales"
    dtype: torch.dtype
    shape: tuple

    @property
    def suffix(self) -> str:
        return f".{self.kind}" if self.kind else ""

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


class QSlice:
    """One expert's quantised matrix (what a QLinear holds, without a module per expert)."""
    __slots__ = ("mode", "layout", "group", "in_features", "out_features", "qweight", "scales")

    def __init__(self, q: QLinear, qweight: torch.Tensor, scales: torch.Tensor):
        self.mode, self.layout, self.group = q.mode, q.layout, q.group
        self.in_features, self.out_features = q.in_features, q.out_features
        self.qweight, self.scales = qweight, scales

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return qproduct(self, x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)


def quantizers(mod: nn.Module, attrs: list[str], mode: str | None) -> dict[str, QLinear]:
    """attr -> the QLinear that quantises each expert's matrix of it (as [out, in]: transposed
    stacks are turned), for the stacked matrices `mode` can hold."""
    out = {}
    for a in attrs if mode else []:
        p = mod._parameters[a] if a in mod._parameters else None
        if p is None or p.dim() != 3:
            continue
        n, k = (p.shape[2], p.shape[1]) if getattr(mod, "is_transposed", False) else (p.shape[1], p.shape[2])
        g = int4_group_for(k) if mode == "int4" else 0
        if mode == "int4" and (g is None or not torch_int4_fits(n)):
            continue
        out[a] = QLinear(k, n, mode, g)
    return out


def expert_parts(mod: nn.Module, attrs: list[str], dtype: torch.dtype, mode: str | None) -> list[Part]:
    """The tensors one expert of `mod` is stored as (quantised where `mode` holds the matrix)."""
    qs = quantizers(mod, attrs, mode)
    parts = []
    for a in attrs:
        shape = tuple(mod._parameters[a].shape[1:])
        if a not in qs:
            parts.append(Part(a, "", dtype, shape))
            continue
        q = qs[a]
        made = q.quantize(torch.zeros(q.out_features, q.in_features), None, dtype)
        parts += [Part(a, kind, t.dtype, tuple(t.shape)) for kind, t in made.items()]
    return parts


class ExpertSlices:
    """Stands for a stacked expert parameter in its module: `[e]` is expert e's slice, installed
    from the cache for this step (an expert the router did not pick this step is not there)."""

    def __init__(self, name: str, shape: tuple, dtype: torch.dtype):
        self.name, self.shape, self.dtype = name, torch.Size(shape), dtype
        self.now: dict[int, torch.Tensor] = {}
        self.landing = None  # e -> None: waits until expert e's reads of this step have landed

    def __getitem__(self, idx) -> torch.Tensor:
        e = int(idx)
        t = self.now.get(e)
        if t is None:
            raise RuntimeError(f"{self.name}: expert {e} was used but not routed to this step (a tierlm bug: "
                               "please report it with the model's config.json)")
        if self.landing is not None:
            self.landing(e)
        return t


@dataclass
class ExpertStats:
    requests: int = 0          # (layer, expert) reads the steps asked for
    hits: int = 0              # ... found in the cache
    hit_bytes: int = 0
    miss_bytes: int = 0
    tokens: int = 0            # tokens the streamed experts modules ran
    stall_s: float = 0.0       # waiting for misses
    per_layer: dict = field(default_factory=dict)  # layer -> [requests, hits]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        return {"requests": self.requests, "hits": self.hits, "hit_rate": round(self.hit_rate, 4),
                "hit_bytes": self.hit_bytes, "miss_bytes": self.miss_bytes, "tokens": self.tokens,
                "stall_s": round(self.stall_s, 3)}


class ExpertCache:
    """Slots of one expert's every tensor (`Part`s: all experts of a model are the same size), in
    one buffer of `capacity` bytes; at least one layer's experts fit (a prefill step may route to
    all of them). key_of(layer, part, expert) names a part in the store."""

    def __init__(self, store, key_of, parts: list[Part], capacity: int, experts: int, policy: str = "lfu",
                 decay: int = 4096):
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.store, self.key_of, self.parts = store, key_of, parts
        self.sizes = [round_up(p.nbytes) for p in parts]
        self.slot_bytes = sum(self.sizes)
        self.slots = int(capacity // self.slot_bytes)
        if self.slots < experts:
            raise ValueError(f"the expert cache holds {self.slots} experts; one layer routes to up to {experts}")
        self.buf = aligned_empty(self.slots * self.slot_bytes)
        self.free = list(range(self.slots - 1, -1, -1))
        self.where: dict[tuple[int, int], int] = {}      # (layer, expert) -> slot
        self.pinned: set[tuple[int, int]] = set()
        self.inflight: dict[tuple[int, int], list] = {}  # (layer, expert) -> its reads not yet waited for
        self.policy, self.decay = policy, decay
        self.count: dict[tuple[int, int], float] = {}    # lfu: requests (halved every `decay`)
        self.last: dict[tuple[int, int], int] = {}       # lru: the request clock at its last use
        self.clock = 0
        self.stats = ExpertStats()
        # each slot's tensors, made once (a decode token asks for ~70 of them)
        self._views = [self._make_views(s) for s in range(self.slots)]

    def _make_views(self, slot: int) -> list[torch.Tensor]:
        out, off = [], slot * self.slot_bytes
        for p, size in zip(self.parts, self.sizes):
            out.append(self.buf[off: off + p.nbytes].view(p.dtype).view(p.shape))
            off += size
        return out

    def views(self, slot: int) -> list[torch.Tensor]:
        return self._views[slot]

    def _victims(self, n: int) -> list[tuple[int, int]]:
        """The n entries to evict, in order (what n successive picks of the least used would give:
        nsmallest is sorted()[:n], ties in the cache's order)."""
        if n <= 0:
            return []
        cands = [k for k in self.where if k not in self.pinned]
        if self.policy == "lru":
            return heapq.nsmallest(n, cands, key=lambda k: self.last[k])
        return heapq.nsmallest(n, cands, key=lambda k: (self.count.get(k, 0.0), self.last[k]))

    def _note(self, k: tuple[int, int]) -> None:
        self.clock += 1
        self.last[k] = self.clock
        self.count[k] = self.count.get(k, 0.0) + 1
        if self.policy == "lfu" and self.clock % self.decay == 0:
            self.count = {key: c / 2 for key, c in self.count.items()}

    def acquire(self, layer: int, experts: list[int]) -> tuple[dict, dict]:
        """Each expert's tensors (in `parts` order), pinned until `release`, and the reads still
        in flight of those that were missing (expert -> futures; `land` waits for them). The misses'
        reads are issued in `experts` order, the order they will be needed in."""
        self._settle()
        got, pending = {}, {}
        st = self.stats
        lay = st.per_layer.setdefault(layer, [0, 0])
        held = set()
        for e in experts:  # what the cache holds is pinned before any miss picks a victim
            k = (layer, e)
            self._note(k)
            st.requests += 1
            lay[0] += 1
            if k in self.where:
                held.add(e)
                self.pinned.add(k)
        victims = self._victims(len(experts) - len(held) - len(self.free))[::-1]
        for e in experts:
            k = (layer, e)
            if e in held:
                slot = self.where[k]
                st.hits += 1
                lay[1] += 1
                st.hit_bytes += self.slot_bytes
            else:
                slot = self.free.pop() if self.free else self.where.pop(victims.pop())
                self.where[k] = slot
                st.miss_bytes += self.slot_bytes
                pending[e] = [self.store.read_into(self.key_of(layer, p, e), t, owns_padding=True)
                              for p, t in zip(self.parts, self.views(slot))]
                self.inflight[k] = pending[e]
            self.pinned.add(k)
            got[e] = self.views(slot)
        return got, pending

    def land(self, layer: int, e: int, futs: list) -> None:
        """Wait for expert e's reads; a failed read leaves no slot that claims to hold it."""
        t0 = time.perf_counter()
        try:
            for f in futs:
                f.result()
        except BaseException:
            self._forget((layer, e))
            raise
        finally:
            self.inflight.pop((layer, e), None)
            self.stats.stall_s += time.perf_counter() - t0

    def _forget(self, k: tuple[int, int]) -> None:
        if k in self.where:
            self.free.append(self.where.pop(k))
        self.pinned.discard(k)

    def _settle(self) -> None:
        """Reads a step left in flight (its forward raised before reaching them) land before any
        slot is reused; a failed one gives its slot back."""
        for k, futs in list(self.inflight.items()):
            for f in futs:
                if f.exception() is not None:
                    self._forget(k)
                    break
            self.inflight.pop(k, None)

    def release(self, layer: int, experts: list[int]) -> None:
        self._settle()
        for e in experts:
            self.pinned.discard((layer, e))


def _routed(args, kwargs, experts: int) -> torch.Tensor:
    """The experts a module's call routes to: its first integer tensor argument (the top-k indices:
    Mixtral's `top_k_index`, GPT-OSS's `router_indices`)."""
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool:
            return v
    raise RuntimeError(f"the experts module was called without the indices of its {experts} experts")


class StreamedExperts:
    """The experts modules of the streamed layers, computing from an `ExpertCache` whose parts are
    those of every module (one experts module a layer). Each stacked parameter's place in its module
    holds an `ExpertSlices` (a plain attribute: the model's parameters() does not list it)."""

    def __init__(self, cache: ExpertCache, layers: dict[int, list], quant: dict[str, QLinear]):
        self.cache, self.quant = cache, quant
        self.handles = []
        for i, mods in layers.items():
            for _, mod, attrs in mods:
                self._install(i, mod, attrs)

    def _install(self, layer: int, mod: nn.Module, attrs: list[str]) -> None:
        slices = {}
        for a in attrs:
            p = mod._parameters.pop(a)
            slices[a] = ExpertSlices(a, tuple(p.shape), p.dtype)
            mod.__dict__[a] = slices[a]
        where = {(p.attr, p.kind): j for j, p in enumerate(self.cache.parts)}
        state: dict = {}

        def made(a: str, views: list[torch.Tensor]):
            if a in self.quant:
                return QSlice(self.quant[a], views[where[(a, "qweight")]], views[where[(a, "scales")]])
            return views[where[(a, "")]]

        def before(m, args, kwargs):
            idx = _routed(args, kwargs, m.num_experts)
            used = [e for e in torch.unique(idx).tolist() if 0 <= e < m.num_experts]  # the loop's order
            got, pending = self.cache.acquire(layer, used)

            def landing(e: int) -> None:
                futs = pending.pop(e, None)
                if futs:
                    self.cache.land(layer, e, futs)

            for a, sl in slices.items():
                sl.now = {e: made(a, views) for e, views in got.items()}
                sl.landing = landing
            state["used"], state["landing"] = used, landing
            self.cache.stats.tokens += int(idx.shape[0]) if idx.dim() > 1 else 1

        def after(m, args, kwargs, out):
            used, landing = state.pop("used", []), state.pop("landing", None)
            for e in used:  # an implementation that skipped a routed expert: its read still lands first
                landing(e)
            for sl in slices.values():
                sl.now, sl.landing = {}, None
            self.cache.release(layer, used)

        self.handles.append(mod.register_forward_pre_hook(before, with_kwargs=True))
        self.handles.append(mod.register_forward_hook(after, with_kwargs=True))


def write_experts(store, moe: dict[int, MoELayer], parts: list[Part], quant: dict[str, QLinear], in_file, st,
                  dtype) -> int:
    """Write every layer's experts to the PieceStore, an expert's parts at a time (where the store
    lacks them), each slice made from that expert's own file tensors and quantised where `quant`
    holds its parameter; returns bytes written."""
    from .weights import Piece

    written = 0
    for i, layer in moe.items():
        for q, mod, attrs in layer.modules:
            for a in attrs:
                name = f"{q}.{a}"
                entry = in_file.get(name)
                if entry is None:
                    raise ValueError(f"the checkpoint has no tensor {name!r} that the model needs; is this the "
                                     "right model directory?")
                mine = [p for p in parts if p.attr == a]
                made = _expert_maker(entry, st, dtype, quant.get(a), getattr(mod, "is_transposed", False))
                pieces = [Piece(expert_key(name, e) + p.suffix, [], p.nbytes,
                                lambda src, e=e, p=p, made=made: made(e)[p.kind])
                          for e in range(layer.experts) for p in mine]
                written += store.ensure(pieces, None)
    return written


def _expert_maker(entry, st, dtype, q: QLinear | None, transposed: bool):
    """e -> {part kind: tensor} of expert e's slice of one stacked parameter; the last expert made
    is kept, as its parts are written one after another."""
    from ..hf.stacked import Stacked, read_param

    memo: dict = {}

    def slice_of(e: int) -> torch.Tensor:
        if isinstance(entry, Stacked) and not entry.whole():
            return entry.expert(st.read, e)[0]
        if "whole" not in memo:  # one file tensor of every expert (or one the family's conversion
            #                      renames and reshapes: Inkling 2's w13_weight): read once, sliced
            memo["whole"] = read_param(st, entry)
        return memo["whole"][e]

    def made(e: int) -> dict[str, torch.Tensor]:
        if memo.get("e") != e:
            t = slice_of(e)
            memo["e"] = e
            if q is None:
                memo["parts"] = {"": t.to(dtype).contiguous()}
            else:
                memo["parts"] = q.quantize((t.t() if transposed else t).float(), None, dtype)
        return memo["parts"]
    return made


class RoutedCount:
    """Resident experts: the bytes of the experts each call routes to (what a step reads of them)."""

    def __init__(self, layers: dict[int, MoELayer]):
        self.bytes = 0
        self.handles = []
        for moe in layers.values():
            for _, mod, attrs in moe.modules:
                per = sum(mod._parameters[a].nbytes // moe.experts for a in attrs)
                self.handles.append(mod.register_forward_pre_hook(
                    lambda m, args, kwargs, per=per: self._add(m, args, kwargs, per), with_kwargs=True))

    def _add(self, m, args, kwargs, per: int) -> None:
        idx = _routed(args, kwargs, m.num_experts)
        self.bytes += per * sum(1 for e in torch.unique(idx).tolist() if 0 <= e < m.num_experts)
