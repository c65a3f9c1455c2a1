"""A decoder layer's decode step in one call of our C kernel (kernels/layer.c).

The lean path (lean.py) makes four kernel calls a layer and ~15 torch ops between them; here the
whole layer (norms, products, per-head q/k norms, rotary embedding, KV cache write, attention,
silu or tanh-approximated gelu, residuals) is one parallel region, its threads meeting at
barriers. It takes the same weights the lean path's products take (int8, our int4 layout, bf16;
fp32 too) and gives the same products; attention is computed in fp32 over the cache as stored.
Which norms and activation a layer has is probed from its modules (`norm_of`, `activation`).

Arguments are kept between calls: pointers used in place (weights, int4 scales, norm weights) are
the key, rebuilt when a streamed layer lands in another buffer; int8 scales and q/k/v biases are
converted to fp32 copies then (a window buffer later holds another layer's).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ..hf.fields import layer_config
from . import native
from .gemv import UPCAST_MIN_ROWS, bf16_matmul_is_slow
from .quant import NATIVE_MAX_ROWS, QLinear

STAGES = (0, 3, 4, 6)  # the first module of q/k/v, o, gate/up, down: their x is rounded once each
FP32_MAX_ROWS = 4  # each weight row is read once per 4 rows of x: past that PyTorch's sgemm wins


ACT_SILU, ACT_GELU_TANH = 0, 1  # kernels/layer.c's TL_ACT_*
QK_NORM = 4  # kernels/layer.c's TL_QK_NORM, beside the q/k norms' TL_NORM_* flags


class LayerW(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in
                ("kind", "hidden", "heads", "kv_heads", "head_dim", "inter", "ln_flags")] + [("group", ctypes.c_int64 * 4),
        ("eps", ctypes.c_double), ("scaling", ctypes.c_double), ("w", ctypes.c_void_p * 7),
        ("s", ctypes.c_void_p * 7), ("bias", ctypes.c_void_p), ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p),
        ("act", ctypes.c_int64), ("qk_norm", ctypes.c_int64), ("qk_eps", ctypes.c_double),
        ("qn", ctypes.c_void_p), ("kn", ctypes.c_void_p)]


class Step(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in
                ("rows", "kv_len", "kv_bf16", "slot_stride", "head_stride", "threads")] + [
        (n, ctypes.c_void_p) for n in ("cos", "sin", "mask", "write_pos")]


class Norm:
    """An RMSNorm module as our kernels take it: its weight (read from the module at each use, as a
    streamed layer's moves), eps, and whether it scales by 1 + weight (Gemma's norms: weights
    stored as offsets from 1, the sum taken in fp32) or by the weight (llama's)."""

    __slots__ = ("mod", "eps", "one_plus")

    def __init__(self, mod, eps: float, one_plus: bool):
        self.mod, self.eps, self.one_plus = mod, eps, one_plus

    @property
    def weight(self) -> torch.Tensor:
        return self.mod.weight

    def args(self) -> tuple:
        """(weight, eps, one_plus): `native.products`' norm."""
        return self.mod.weight, self.eps, self.one_plus

    def flags(self) -> int:
        return native.norm_flags(self.mod.weight, self.one_plus)

    def scale(self) -> torch.Tensor:
        """What the normalised x is multiplied by, fp32."""
        w = self.mod.weight.float()
        return w + 1 if self.one_plus else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The module's result on fp32 x [..., K], in fp32 (torch ops)."""
        w = self.mod.weight
        if self.one_plus:
            w = w.float() + 1
        elif w.dtype != x.dtype:
            w = w.float()
        return F.rms_norm(x, w.shape, w, self.eps)


_NORM_FORMULAS: dict = {}


def norm_of(mod, n: int) -> Norm | None:
    """`mod`, a norm over the last `n` features, as a Norm; None where it is not an RMSNorm of
    either formula over `n` (a LayerNorm, a norm without weight, one that rounds or scales
    otherwise, olmo2's q/k norms over all heads where each head's is asked). Found by running the
    module (on a probe weight in place of its own, which a streamed layer does not hold until it
    runs) on rows of different sizes against both formulas: no list of norm classes to keep up
    with."""
    if mod is None:
        return None
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if not isinstance(eps, (float, int)) or list(mod._parameters) != ["weight"] or list(mod.children()):
        return None
    w = mod._parameters["weight"]  # None: a streamed layer's, not installed now
    if w is not None and tuple(w.shape) != (n,):
        return None
    eps = float(eps)
    key = (type(mod), n, eps)
    if key not in _NORM_FORMULAS:
        g = torch.Generator().manual_seed(0)
        pw = torch.rand(n, generator=g) + 0.5
        # rows of mean square ~1, ~eps (so eps is checked) and ~1e3
        x = torch.randn(3, n, generator=g) * torch.tensor([[1.0], [eps ** 0.5 + 1e-30], [30.0]])
        try:
            with torch.no_grad():
                out = torch.func.functional_call(mod, {"weight": pw}, (x,))
        except Exception:  # noqa: BLE001 -- a module that does not run on a probe is not one we know
            out = None
        found = None
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == x.shape:
            for one_plus in (False, True):
                ref = F.rms_norm(x, (n,), pw + 1 if one_plus else pw, eps)
                if ((out - ref).abs().amax(-1) <= 1e-5 * ref.abs().amax(-1)).all():
                    found = one_plus
        _NORM_FORMULAS[key] = found
    one_plus = _NORM_FORMULAS[key]
    return None if one_plus is None else Norm(mod, eps, one_plus)


def activation(act_fn) -> int | None:
    """ACT_SILU or ACT_GELU_TANH where the module computes that (probed, as norm_of does: one class
    may compute either, nn.GELU), else None: the fused layer has no other."""
    x = torch.linspace(-12, 12, 241)
    try:
        with torch.no_grad():
            y = act_fn(x)
    except Exception:  # noqa: BLE001 -- a module that does not run on a probe is not one we know
        return None
    if isinstance(y, torch.Tensor) and y.shape == x.shape:
        for code, ref in ((ACT_SILU, F.silu(x)), (ACT_GELU_TANH, F.gelu(x, approximate="tanh"))):
            if ((y - ref).abs() <= 1e-6 * (1 + ref.abs())).all():
                return code
    return None


def _kind(m) -> tuple[int, int] | None:
    """(kernel kind, int4 group) of a linear module's weights, or None where the kernel has none."""
    if isinstance(m, QLinear):
        if m.qweight is None:
            return None
        if m.mode == "int8":
            return native.INT8, 0
        return (native.INT4, m.group) if m.layout == "tierlm" else None
    w = getattr(m, "weight", None)
    if w is None or w.device.type != "cpu" or not w.is_contiguous():
        return None
    return {torch.bfloat16: (native.BF16, 0), torch.float32: (native.FP32, 0)}.get(w.dtype)


def rows_served(kind: int, rows: int) -> bool:
    """Whether our kernels take this many rows of x for this kind (as lean.Products decides)."""
    if kind in (native.INT8, native.INT4):
        return rows <= NATIVE_MAX_ROWS
    if kind == native.BF16:
        return rows == 1 or (rows < UPCAST_MIN_ROWS and bf16_matmul_is_slow())
    return rows <= FP32_MAX_ROWS


class StepArgs:
    """What every layer's call shares in one decode step: rotary cos/sin, the masks as additive
    fp32 [rows, positions] (one per mask kind), where each row's new key goes, the scratch."""

    def __init__(self, cos, sin, mask, cache, scratch_holder):
        b = cos.shape[0]
        self.cos = cos.reshape(b, -1).float().contiguous()
        self.sin = sin.reshape(b, -1).float().contiguous()
        self.pos = cache._write_pos[:, 0].contiguous()
        kc = cache.k[0]
        masks = mask if isinstance(mask, dict) else {None: mask}
        self.additive, self.steps = {}, {}
        for name, m in masks.items():
            m = m.reshape(b, -1)
            add = torch.zeros(m.shape).masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else m.float()
            self.additive[name] = add.contiguous()
            st = Step(rows=b, kv_len=m.shape[1], kv_bf16=int(kc.dtype == torch.bfloat16), slot_stride=kc.stride(0),
                      head_stride=kc.stride(1), threads=torch.get_num_threads())
            st.cos, st.sin, st.mask, st.write_pos = (self.cos.data_ptr(), self.sin.data_ptr(),
                                                      self.additive[name].data_ptr(), self.pos.data_ptr())
            self.steps[name] = st
        self._holder = scratch_holder
        self._need: dict = {}  # scratch bytes by the layer's (kind, groups): the same for every layer

    def step(self, sliding: bool) -> Step:
        return self.steps.get("sliding_attention" if sliding else "full_attention") or self.steps[None]

    def scratch(self, w: LayerW, st: Step) -> int:
        key = (w.kind, tuple(w.group), id(st))
        nbytes = self._need.get(key)
        if nbytes is None:
            nbytes = self._need[key] = native.library().tierlm_layer_scratch_bytes(ctypes.byref(w), ctypes.byref(st))
        return self.buffer(nbytes).data_ptr()

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The scratch the layers share (kept between steps), grown to at least `nbytes`."""
        buf = self._holder.get("buf")
        if buf is None or buf.numel() * 4 < nbytes:
            buf = self._holder["buf"] = torch.empty(nbytes // 4 + 16, dtype=torch.float32)
        return buf


class FusedLayer:
    def __init__(self, layer, config, resident: bool = False):
        a, m = layer.self_attn, layer.mlp
        self.mods = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        h = config.hidden_size
        self.norms = (norm_of(layer.input_layernorm, h), norm_of(layer.post_attention_layernorm, h))
        has_qk = getattr(a, "q_norm", None) is not None or getattr(a, "k_norm", None) is not None
        self.qk_norms = (norm_of(getattr(a, "q_norm", None), a.head_dim),
                         norm_of(getattr(a, "k_norm", None), a.head_dim)) if has_qk else None
        self.act = activation(m.act_fn)
        own = layer_config(config, a.layer_idx) if hasattr(a, "layer_idx") else config  # (Gemma 4's layers differ)
        kvh = getattr(own, "num_key_value_heads", None) or config.num_attention_heads
        self.why = self._why()  # None where kernels/layer.c computes this layer
        self.w = LayerW(hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=kvh,
                        head_dim=a.head_dim, inter=m.gate_proj.out_features,
                        eps=self.norms[0].eps if self.norms[0] else 0.0, scaling=a.scaling,
                        act=self.act or 0, qk_eps=self.qk_norms[0].eps if self.why is None and has_qk else 0.0)
        self._key = None
        self._kind = None
        # what kernels/layer.c takes (it refuses the rest with -3): other geometries keep lean's path
        self._geometry_ok = self.why is None and a.head_dim % 2 == 0 and a.head_dim <= 512 and \
            config.num_attention_heads % kvh == 0
        # a resident layer's weights never move: once its arguments are built, only the rows are
        # checked (a decode step's Python is ~1 ms of a ~40 ms token; this was a third of it)
        self._resident = resident

    def _why(self) -> str | None:
        """Why the C layer cannot compute this layer's maths (the per-product path can still)."""
        if self.act is None:
            return "an activation other than silu and tanh-approximated gelu"
        if None in self.norms or len({(n.eps, n.one_plus) for n in self.norms}) != 1:
            return "norms before attention and MLP that are not RMSNorms of one eps and formula"
        if self.qk_norms is not None and (None in self.qk_norms or
                                          len({(n.eps, n.one_plus) for n in self.qk_norms}) != 1):
            return "q/k norms that are not RMSNorms over each head"
        return None

    def weights_moved(self) -> None:
        """The layer's weights were installed elsewhere (InferenceEngine.reinstall): the kept
        arguments are rebuilt at the next call."""
        self._key = None

    def ready(self, rows: int) -> bool:
        """Whether this layer's weights (as installed now) and `rows` go to the kernel; builds the
        kept arguments when the weights moved."""
        if self._resident and self._key is not None:
            return rows_served(self._kind, rows) and native.available()
        if not self._geometry_ok:
            return False
        kinds = [_kind(m) for m in self.mods]
        if None in kinds or len({k for k, _ in kinds}) != 1:
            return False
        kind = kinds[0][0]
        # int4: the products sharing an x (q, k, v; gate, up) share its rounding, so their group
        group = tuple(kinds[i][1] for i in STAGES)
        if any(kinds[j][1] != kinds[i][1] for i, j in ((0, 1), (0, 2), (4, 5))):
            return False
        if not rows_served(kind, rows) or not native.available():
            return False
        norms = [n.weight for n in self.norms]
        qk = [n.weight for n in self.qk_norms] if self.qk_norms else []
        if any(t.dtype not in (torch.float32, torch.bfloat16) or t.dtype != ts[0].dtype or not t.is_contiguous()
               for ts in (norms, qk) for t in ts):
            return False
        ws = [m.qweight if isinstance(m, QLinear) else m.weight for m in self.mods]
        inplace = ws + norms + qk + ([m.scales for m in self.mods] if kind == native.INT4 else [])
        key = (kind, group) + tuple(t.data_ptr() for t in inplace)
        if key != self._key:
            if kind == native.INT4 and any(m.scales.dtype != torch.float32 or not m.scales.is_contiguous()
                                           for m in self.mods):
                return False
            self._build(kind, group, ws)
            self._key, self._kind = key, kind
        return True

    def _build(self, kind, group, ws):
        w = self.w
        w.kind, w.ln_flags = kind, self.norms[0].flags()
        w.group[:] = group
        if kind == native.INT8:
            # a copy even when fp32 already: a streamed layer's scales live in a window buffer
            scales = [m.scales.to(torch.float32, copy=True).contiguous() for m in self.mods]
        elif kind == native.INT4:
            scales = [m.scales for m in self.mods]
        else:
            scales = None
        for j in range(7):
            w.w[j] = ws[j].data_ptr()
            w.s[j] = scales[j].data_ptr() if scales else None
        biases = [m.bias for m in self.mods[:3]]
        if all(b is None for b in biases):
            bias = None
        else:
            bias = torch.cat([torch.zeros(m.out_features) if b is None else b.float() for m, b in
                              zip(self.mods[:3], biases)]).contiguous()
        w.bias = None if bias is None else bias.data_ptr()
        w.ln1, w.ln2 = (n.weight.data_ptr() for n in self.norms)
        if self.qk_norms:
            w.qk_norm = QK_NORM | self.qk_norms[0].flags()
            w.qn, w.kn = (n.weight.data_ptr() for n in self.qk_norms)
        # only the copies: holding a streamed layer's own tensors would keep them past its window
        self._keep = (scales if kind == native.INT8 else None, bias)

    def __call__(self, x: torch.Tensor, args: StepArgs, sliding: bool, kc: torch.Tensor, vc: torch.Tensor) -> None:
        """x fp32 [rows, hidden], contiguous, updated in place; kc/vc this layer's cache."""
        lib = native.library()
        st = args.step(sliding)
        scratch = args.scratch(self.w, st)
        rc = lib.tierlm_layer_decode(ctypes.byref(self.w), ctypes.byref(st), x.data_ptr(), kc.data_ptr(),
                                     vc.data_ptr(), scratch)
        if rc != 0:
            raise ValueError(f"the fused decoder layer refused its arguments (code {rc}): int4 groups "
                             f"{list(self.w.group)} against hidden {self.w.hidden}, head dim {self.w.head_dim}")


class FusedStack:
    """Every decoder layer in one C call a decode step (tierlm_layers_decode), where all of them
    are fused and resident: kernels/layer.c says why."""

    def __init__(self, layers: list[FusedLayer], sliding: list[bool]):
        self.layers, self.sliding = layers, sliding
        n = len(layers)
        self._w = (ctypes.c_void_p * n)(*[ctypes.addressof(f.w) for f in layers])
        self._kv = None
        self._info = ctypes.c_int64(0)

    def __call__(self, x: torch.Tensor, args: StepArgs, cache) -> None:
        """x fp32 [rows, hidden], contiguous, through every layer in place; `cache` the engine's."""
        lib, n = native.library(), len(self.layers)
        if self._kv is None or self._kv[0] is not cache:
            self._kv = (cache, (ctypes.c_void_p * n)(*[t.data_ptr() for t in cache.k]),
                        (ctypes.c_void_p * n)(*[t.data_ptr() for t in cache.v]))
        steps = (ctypes.c_void_p * n)(*[ctypes.addressof(args.step(s)) for s in self.sliding])
        need = 0
        for _ in range(2):  # the C says how much scratch the step's longest attention needs
            buf = args.buffer(need)
            rc = lib.tierlm_layers_decode(self._w, steps, n, x.data_ptr(), self._kv[1], self._kv[2],
                                          buf.data_ptr(), buf.numel() * 4, ctypes.byref(self._info))
            if rc != -4:
                break
            need = self._info.value
        if rc == -4:  # the buffer was grown to what the C asked: a tierlm bug
            raise RuntimeError(f"the fused layers asked for {self._info.value} bytes of scratch twice")
        if rc != 0:
            w = self.layers[self._info.value].w
            raise ValueError(f"the fused decoder layer {self._info.value} refused its arguments (code {rc}): int4 "
                             f"groups {list(w.group)} against hidden {w.hidden}, head dim {w.head_dim}")
