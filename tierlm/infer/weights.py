"""Where each inference weight comes from, how it is stored, and the stream of non-resident layers.

A `Piece` is one tensor the model runs with: a parameter in the compute dtype, or a quantised
linear map's packed weight, scales and bias. Its bytes are known before anything is read, so the
placement is planned first; then resident pieces are read from the HF safetensors straight into
the modules, and the pieces of streamed layers are written once to the NVMe store in their final
form (compute dtype or packed) and read back a whole layer at a time.

The stream holds one layer computing and `prefetch` layers read ahead, in cyclic order: after the
last streamed layer it reads the first ones for the next forward (decode repeats the same walk).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..hf.structure import kept_fp32, module_param_slots
from ..storage import HostBufferPool, TensorStore
from ..storage.aligned import aligned_empty, round_up
from .quant import QLinear, replace_linears


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Piece:
    key: str                  # store key: the HF name (or the quantised linear's name + part)
    slots: list               # [(module, attribute)] it is installed in (two for tied weights)
    nbytes: int
    make: object              # callable(src) -> the tensor in its final form; src(name) reads HF
    is_param: bool = True     # installed in module._parameters (else a plain attribute)
    # known before reading (a plain parameter): read straight into its place, make(src, out=...)
    spec: tuple | None = None  # (dtype, shape)

    def install(self, t: torch.Tensor | None) -> None:
        # A plain tensor in _parameters: modules read it as self.weight, and no autograd
        # bookkeeping (Parameter.data) is involved at inference.
        for mod, attr in self.slots:
            if self.is_param:
                mod._parameters[attr] = t
            else:
                setattr(mod, attr, t)

    def installed(self) -> torch.Tensor | None:
        """The tensor installed now (None where a streamed layer's is not)."""
        mod, attr = self.slots[0]
        return mod._parameters.get(attr) if self.is_param else getattr(mod, attr, None)


def plan_pieces(model: nn.Module, blocks, dtype: torch.dtype, mode: str | None) -> dict[int, list[Piece]]:
    """block index -> its pieces. Decoder layers' linear maps become QLinear when `mode` is set.
    A tied weight (one tensor in the embedding and the head) is one piece installed in both. The
    parameters transformers keeps in fp32 when it loads the model in `dtype` (a mixture's router
    weights: hf.structure.kept_fp32) are kept so here, as its modules expect."""
    wide = kept_fp32(model, dtype)

    slots = module_param_slots(model)
    canon = {(id(m), a): n for n, ss in slots.items() for m, a in ss}
    transposed: set[str] = set()
    if not mode:
        for blk in blocks:
            if blk.kind == "layer":
                transposed.update(w for _, w in _conv1d_as_linear(blk.module, canon))
        slots = module_param_slots(model)  # the same names, now on the new modules
        canon = {(id(m), a): n for n, ss in slots.items() for m, a in ss}
    out: dict[int, list[Piece]] = {}
    seen: set[str] = set()
    in_layers: set[str] = set()  # what an earlier decoder layer uses
    for blk in blocks:
        pieces: list[Piece] = []
        # a weight two decoder layers share (Zamba's hybrid layers run one attention block, tied)
        # is a piece of each, installed in that layer's modules only: a streamed layer's release
        # must not take it from the other, which may run next (the store keeps it once)
        own = {id(m) for m in blk.module.modules()} if blk.kind == "layer" else None
        taken: set[str] = set(seen) - in_layers if own is not None else set(seen)
        if blk.kind == "layer" and mode:
            for q, conv, old in replace_linears(blk.module, mode).values():
                wname = canon[(id(old), "weight")]
                bname = canon.get((id(old), "bias")) if q.has_bias else None
                taken.update(n for n in (wname, bname) if n)
                pieces.extend(_qlinear_pieces(q, conv, wname, bname, dtype))

        for name in blk.uses:
            if name in taken:
                continue
            mods = [(m, a) for m, a in slots[name] if not isinstance(m, QLinear)]
            if own is not None and name in in_layers:
                mods = [(m, a) for m, a in mods if id(m) in own]
            numel = mods[0][0]._parameters[mods[0][1]].numel()
            shape = tuple(mods[0][0]._parameters[mods[0][1]].shape)
            dt = torch.float32 if name in wide else dtype
            if name in transposed:  # its own store key: a store written untransposed is not reused
                pieces.append(Piece(name + ".T", mods, numel * _esize(dt), _transposed(name, dt),
                                    spec=(dt, shape)))
                continue
            pieces.append(Piece(name, mods, numel * _esize(dt), _reader(name, dt), spec=(dt, shape)))
        seen.update(blk.uses)
        if own is not None:
            in_layers.update(blk.uses)
        out[blk.index] = pieces
    return out


def _conv1d_as_linear(layer: nn.Module, canon: dict) -> list[tuple[nn.Linear, str]]:
    """Swap each transformers Conv1D of a layer (GPT-2's; W stored [in, out]) for an nn.Linear on
    `meta` that takes W transposed once, at load: a one-row product then reads the weight's rows on
    the matrix-vector kernel (gemv.py; measured on a 2-vCPU Zen 4 VM, a 2048 x 8192 bf16 weight: our
    kernel on the transposed copy several times the rate of torch's addmm or mv on the [in, out]
    one). Returns (the new module, the checkpoint weight's name); the bias stays the same piece."""
    from transformers.pytorch_utils import Conv1D

    out = []
    for name, mod in list(layer.named_modules()):
        if not isinstance(mod, Conv1D):
            continue
        k, n = mod.weight.shape
        lin = nn.Linear(k, n, bias=mod.bias is not None, device="meta")
        parent_name, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(parent_name) if parent_name else layer, attr, lin)
        out.append((lin, canon[(id(mod), "weight")]))
    return out


def _transposed(name: str, dtype: torch.dtype):
    def make(src, out: torch.Tensor | None = None):
        t = src(name).t()
        return t.to(dtype).contiguous() if out is None else out.copy_(t)
    return make


def _reader(name: str, dtype: torch.dtype):
    def make(src, out: torch.Tensor | None = None):
        t = src(name)
        if out is None:
            return t.to(dtype)
        if tuple(t.shape) != tuple(out.shape):
            raise ValueError(f"the checkpoint's {name!r} has shape {tuple(t.shape)} where the model's config "
                             f"makes it {tuple(out.shape)}; does config.json belong to these weights?")
        return out.copy_(t)  # the same rounding as .to(dtype), without a second copy in memory
    return make


def install_resident(pieces: list[Piece], src, pin: bool = False) -> torch.Tensor:
    """Make a block's pieces and install them as views of one buffer, back to back in the order
    the block's forward reads them (each 4 KiB-aligned, so the bytes equal the placement's sum of
    round_up(nbytes)). Returns the buffer.

    Why one buffer: a tensor of its own is an mmap of its own, whose first and last partial 2 MiB
    stay on 4 KiB pages (TinyLlama's layers: 6 of each 8 MiB q and o matrix on huge pages, k and v
    none), and PyTorch's huge-page switch works only when tierlm was imported before torch. The
    buffer is 2 MiB-aligned and advised huge (aligned_empty) wherever it was imported from, and a
    layer's products read one run of memory. TinyLlama-1.1B bf16 on a 2-vCPU Zen 4 VM, decode alternated on
    one engine against each tensor in an allocation of its own (benchmarks/infer_bench.py --layout,
    3 runs of 6 rounds): faster in 17 of 18 rounds at 1 thread (median +10%), 15 of 18 at 2 threads
    (+3%; docs/inference.md at a2b1c1e).

    pin: registered with CUDA (a layer a GPU copies from its host memory every step)."""
    sizes = [round_up(p.nbytes) for p in pieces]
    buf = aligned_empty(sum(sizes), pin=pin)
    off = 0
    for p, n in zip(pieces, sizes):
        slot = buf[off: off + p.nbytes]
        if p.spec is not None:
            dt, shape = p.spec
            t = p.make(src, out=slot.view(dt).view(shape))
        else:
            made = p.make(src)
            if made.numel() * made.element_size() != p.nbytes:
                raise RuntimeError(f"{p.key}: made {made.numel() * made.element_size()} bytes where the "
                                   f"placement planned {p.nbytes} (a tierlm bug: please report it)")
            t = slot.view(made.dtype).view(made.shape).copy_(made)
            del made
        p.install(t)
        off += n
    return buf


def _qlinear_pieces(q: QLinear, conv: bool, wname: str, bname: str | None, dtype) -> list[Piece]:
    names = q.tensor_names()
    # One quantisation serves the linear's two or three pieces; dropped once all are taken.
    state = {"v": None, "left": set(names)}

    def make_one(t):
        def make(src):
            if state["v"] is None:
                w = src(wname)
                state["v"] = q.quantize(w.t() if conv else w, src(bname) if bname else None, dtype)
            v = state["v"][t]
            state["left"].discard(t)
            if not state["left"]:
                state["v"], state["left"] = None, set(names)
            return v
        return make

    n, k = q.out_features, q.in_features
    if q.mode == "int8":
        sizes = {"qweight": n * k, "scales": n * _esize(dtype)}
    else:
        sizes = {"qweight": n * k // 2, "scales": (k // q.group) * n * 2 * (4 if q.layout == "tierlm" else _esize(dtype))}
    sizes["bias"] = n * _esize(dtype)
    base = wname[: -len(".weight")]
    return [Piece(f"{base}.{t}", [(q, t)], sizes[t], make_one(t), is_param=False) for t in names]


def fingerprint(model_dir: Path, dtype: torch.dtype, mode: str | None) -> str:
    """What the stored pieces were made from: a changed checkpoint or format rewrites the store."""
    h = hashlib.sha256()
    h.update((Path(model_dir) / "config.json").read_bytes())
    for p in sorted(Path(model_dir).glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(f"{dtype}:{mode}".encode())
    return h.hexdigest()[:16]


class PieceStore:
    """The NVMe copy of the streamed layers, written once and reused while the checkpoint and
    format are unchanged (a manifest with the fingerprint sits beside the tensors)."""

    MANIFEST = "infer_store.json"

    def __init__(self, root: Path, pool: HostBufferPool, fp: str, io_threads: int = 4, direct_io=None):
        self.root = Path(root)
        self.store = TensorStore(self.root, pool, io_threads=io_threads, direct_io=direct_io)
        self.fp = fp
        path = self.root / self.MANIFEST
        if path.exists():
            m = json.loads(path.read_text())
            if m.get("fingerprint") == fp:
                self.store.load_manifest(m["records"])

    def ensure(self, pieces: list[Piece], src) -> int:
        """Write the pieces the store lacks; returns bytes written."""
        written = 0
        for p in pieces:
            if p.key in self.store:
                continue
            t = p.make(src)
            self.store.write(p.key, t).result()
            written += p.nbytes
        if written:
            tmp = self.root / (self.MANIFEST + ".tmp")
            tmp.write_text(json.dumps({"fingerprint": self.fp, "records": self.store.manifest()}))
            os.replace(tmp, self.root / self.MANIFEST)
        return written

    def close(self) -> None:
        self.store.close()


class LayerStream:
    """Streamed layers through a pool of (prefetch + 1) layer buffers, read ahead cyclically."""

    def __init__(self, store: TensorStore, pool: HostBufferPool, layers: dict[int, list[Piece]], prefetch: int):
        self.store, self.pool, self.layers = store, pool, layers
        self.order = sorted(layers)
        self.prefetch = prefetch
        self._live: dict[int, tuple] = {}   # layer -> (buffer, {key: tensor}, [futures])
        self.layer_bytes = {i: sum(round_up(p.nbytes) for p in ps) for i, ps in layers.items()}
        self.stall_s = 0.0

    def _start(self, i: int, blocking: bool) -> bool:
        size = self.layer_bytes[i]
        buf = self.pool.acquire(size) if blocking else self.pool.try_acquire(size)
        if buf is None:
            return False
        views, futs, off = {}, [], 0
        for p in self.layers[i]:
            rec = self.store.record(p.key)
            dt = getattr(torch, rec.dtype)
            t = buf.tensor[off: off + rec.nbytes].view(dt).view(rec.shape)
            futs.append(self.store.read_into(p.key, t, owns_padding=True))
            views[p.key] = t
            off += round_up(p.nbytes)
        self._live[i] = (buf, views, futs)
        return True

    def prefetch_after(self, i: int | None) -> None:
        if not self.order:
            return
        k = 0 if i is None else self.order.index(i) + 1
        for d in range(self.prefetch):
            j = self.order[(k + d) % len(self.order)]
            if j not in self._live and not self._start(j, blocking=False):
                return

    def acquire(self, i: int) -> None:
        views = self.take(i)
        for p in self.layers[i]:
            p.install(views[p.key])

    def take(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's tensors in its window buffer once read (piece key -> view), not installed: a
        device copies them (tierlm.infer.device_layers); `release(i)` gives the buffer back."""
        import time
        if i not in self._live:
            self._start(i, blocking=True)
        self.prefetch_after(i)
        buf, views, futs = self._live[i]
        t0 = time.perf_counter()
        for f in futs:
            f.result()  # raises CorruptionError naming the file
        self.stall_s += time.perf_counter() - t0
        return views

    def release(self, i: int) -> None:
        for p in self.layers[i]:
            p.install(None)
        buf, _, _ = self._live.pop(i)
        buf.release()
        self.prefetch_after(i)

    def close(self) -> None:
        for i in list(self._live):
            buf, _, futs = self._live.pop(i)
            for f in futs:
                f.exception()
            buf.release()
