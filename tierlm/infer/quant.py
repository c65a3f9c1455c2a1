"""Quantised linear layers on PyTorch's own CPU kernels, chosen at load time.

int8: symmetric, one scale per output channel, `aten._weight_int8pack_mm`; up to NATIVE_MAX_ROWS rows
(decoding) on our own kernel (`tierlm.infer.native`) where it builds: PyTorch's is compute-bound at a
few rows on AVX2 CPUs (benchmarks/infer_gemv.py on a 2-vCPU EPYC, 2 threads: one row 15.3 GB/s of
int8 against 9.4, 32 rows 1.15 against 1.13).

More rows (a prefill) of either format, where our kernels run on AVX2 or higher: x is rounded to 8 bits
a group (int8: 128, 64 or 32 inputs, the first that divides K; int4: the weights' group) and the
product is integer sums per group on the CPU's int8 dot products (kernels/qgemm.c), as llama.cpp's
Q8_0/Q4_0 products are; elsewhere the products below (x as it is, fp32 or bf16 sums).
int4: asymmetric, one scale and offset per group of `group` input elements (w = q * scale + lo,
q in 0..15). Where our kernels build, in their own layout (`int4_layout()` "tierlm": nibbles in
kernels/gemv.c's order, fp32 (scale, lo) pairs [N, K/group, 2]): up to NATIVE_MAX_ROWS rows on
our kernel, more rows in integers as above or, without AVX2, dequantised to fp32 a matrix at a
time and multiplied in fp32 (`fp32_product`).
PyTorch's `aten._weight_int4pack_mm_for_cpu` reads int4 at ~5 GB/s at one row here, a quarter of
our int8 kernel, so int4 was the slowest format to decode. Without a compiler, PyTorch's layout
("torch": `aten._convert_weight_to_int4pack_for_cpu`, the layout gpt-fast/torchao use:
value = (q - 8) * scale + zero) and its kernel.

Only the decoder layers' linear maps are quantised: embeddings, norms and the head stay in the
compute dtype (the head is where most of the quality goes, and it is read once per token anyway).
"""
from __future__ import annotations

import functools
import inspect
import re

import torch
import torch.nn.functional as F
from torch import nn

from . import fp32_product, native, qgemm

MODES = ("int8", "int4")
NATIVE_MAX_ROWS = 32  # ours measured faster up to 16 rows (2.4 against 1.8 GB/s), level at 32
# PyTorch's CPU int8 kernel (aten._weight_int8pack_mm, torch 2.13) reads past the end of a row whose
# width K its vector width does not divide: on a Zen 5 (AVX-512) a K of 24 crashed the process or
# gave inf, on AVX2 a K of 100 did; widths a multiple of 32 ran right on both. Other widths (tiny
# models, odd projections) multiply the dequantised weights instead.
TORCH_INT8_K = 32
TORCH_INT4_N = 16  # aten._convert_weight_to_int4pack_for_cpu packs outputs 16 at a time
INT4_GROUPS = (32, 64, 128, 256)
_integer_rows = True  # use_integer_rows(False): benchmarks compare with the fallback in one process


def use_integer_rows(on: bool) -> None:
    """Whether many-row products take the 8-bit integer kernel where it is fast (the default) or
    the dequantised fallback, from now on; for side-by-side benchmarks."""
    global _integer_rows
    _integer_rows = bool(on)


def _int8(w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    w = w.float().contiguous()  # GPT-2's transposed Conv1D weight; the kernel wants rows
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return {"qweight": q, "scales": scale.to(dtype)}


def int4_layout() -> str:
    """"tierlm" where our kernels build and are switched on (`native.use`) when a module is made,
    else "torch"; the stored layers' fingerprint names it."""
    return "tierlm" if native.available() else "torch"


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> [N, K/2] uint8: in each block of 32 inputs, byte i holds input i in its
    low nibble and input i + 16 in its high one (kernels/gemv.c)."""
    n, k = q.shape
    b = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)


def dequant_int4(qweight: torch.Tensor, scale_lo: torch.Tensor, group: int) -> torch.Tensor:
    """Our int4 layout back to fp32 [N, K] in torch ops (the reference for native.dequant_int4)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    b = qweight.view(n, k // 32, 1, 16)
    q = torch.cat([b & 15, b >> 4], 2).reshape(n, k // group, group).float()
    return (q * scale_lo[..., :1] + scale_lo[..., 1:]).reshape(n, k)


def _int4(w: torch.Tensor, dtype: torch.dtype, group: int, layout: str) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    if layout == "tierlm":
        return {"qweight": pack_int4(q), "scales": torch.stack([scale, lo], -1).contiguous()}
    zero = lo + 8 * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype)  # [k/group, n, 2]
    return {"qweight": packed, "scales": sz}


def torch_int4_fits(n: int) -> bool:
    """Whether n outputs can be held in int4 in the layout in use: PyTorch's packing (without our
    kernels) refuses widths it does not divide into 16 ("expect N to be dividable by 16")."""
    return int4_layout() != "torch" or n % TORCH_INT4_N == 0


def int4_group_for(k: int, want: int = 128) -> int | None:
    """The largest supported group size <= want that divides k (None: cannot pack this width)."""
    for g in sorted(INT4_GROUPS, reverse=True):
        if g <= want and k % g == 0:
            return g
    return None


class QLinear(nn.Module):
    """y = x W^T + b with W quantised; tensors are plain attributes set by the loader."""

    def __init__(self, in_features: int, out_features: int, mode: str, group: int = 0, has_bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.mode, self.group = in_features, out_features, mode, group
        self.has_bias = has_bias
        self.layout = int4_layout() if mode == "int4" else None
        self.qweight = self.scales = self.bias = None

    def tensor_names(self) -> list[str]:
        return ["qweight", "scales"] + (["bias"] if self.has_bias else [])

    def quantize(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> dict:
        """weight [out, in] in any float dtype -> the tensors this module holds."""
        out = _int8(weight, dtype) if self.mode == "int8" else _int4(weight, dtype, self.group, self.layout)
        if self.has_bias:
            out["bias"] = bias.to(dtype)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = qproduct(self, x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def integer_rows(self, x2: torch.Tensor) -> bool:
        """Whether x2's rows (more than NATIVE_MAX_ROWS) multiply in 8-bit integers on our
        many-row kernel (`qgemm.product`): where it runs on the CPU's integer dot products (the
        active path is avx2 or higher), for int8 weights whose width a group of x divides and
        our int4 layout. The fallback, where it does not, is the dequantised product below."""
        if not _integer_rows or x2.device.type != "cpu" or not native.available() or not qgemm.fast():
            return False
        if self.mode == "int8":
            return qgemm.x_group(self.in_features) is not None
        return self.layout == "tierlm"

    def extra_repr(self) -> str:
        g = f", group={self.group}" if self.mode == "int4" else ""
        return f"{self.in_features} -> {self.out_features}, {self.mode}{g}"


def qproduct(q, x2: torch.Tensor) -> torch.Tensor:
    """x2 [rows, in] times the quantised W^T of `q` (a QLinear, or anything with its mode, layout,
    group, in/out features, qweight and scales), in x2's dtype, without the bias."""
    if x2.device.type != "cpu":
        return F.linear(x2, device_weight(q, x2.dtype))
    few = x2.shape[0] <= NATIVE_MAX_ROWS and x2.device.type == "cpu" and native.available()
    if not few and QLinear.integer_rows(q, x2):
        return qgemm.product(x2, q.qweight, q.scales, q.group).to(x2.dtype)
    if q.mode == "int8" and few:
        return native.gemv_int8(x2, q.qweight, q.scales).to(x2.dtype)
    if q.layout == "tierlm" and few:
        return native.gemv_int4(x2, q.qweight, q.scales, q.group).to(x2.dtype)
    if q.layout == "tierlm":  # a prefill: one matrix in fp32 at a time (scratch_bytes counts it)
        if native.available():
            w = native.dequant_int4(q.qweight, q.scales, q.group,
                                    out=fp32_product.scratch(q.out_features * q.in_features))
        else:
            w = dequant_int4(q.qweight, q.scales, q.group)
        return fp32_product.product(x2.float(), w).to(x2.dtype)
    if q.mode == "int8":
        if q.in_features % TORCH_INT8_K == 0:
            return torch.ops.aten._weight_int8pack_mm(x2, q.qweight, q.scales)
        return F.linear(x2, device_weight(q, x2.dtype))
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, q.qweight, q.group, q.scales)


def device_weight(q, dtype: torch.dtype) -> torch.Tensor:
    """W [out, in] in `dtype`, dequantised where the weights are (a GPU: our kernels are CPU code).
    One matrix at a time in torch's own ops, then torch's product: the bus and the device memory
    carry the quantised bytes, the product reads the dequantised copy. int8: q * its row's scale;
    int4 in our layout: q * scale + lo a group (PyTorch's CPU int4 layout has no GPU kernel)."""
    if q.mode == "int8":
        return q.qweight.to(dtype) * q.scales.to(dtype)[:, None]
    if q.layout != "tierlm":
        raise ValueError("--weights int4 on a GPU needs tierlm's int4 layout, made where its kernels build "
                         "(a C compiler, `cc`); use --weights int8 or bf16")
    return dequant_int4(q.qweight, q.scales, q.group).to(dtype)


def _expert_counts(layer: nn.Module) -> set[int]:
    """The expert counts of a layer's mixtures (of MLP or attention experts). A linear map of the
    layer's width onto that many outputs is a router, kept in the compute dtype as llama.cpp keeps
    its routers: its logits choose experts, and a rounding there can swap whole experts, for a
    matrix of a few thousandths of the layer. Some families also read the router's `.weight`
    themselves (Hunyuan's dtype check, which a QLinear failed)."""
    counts = set()
    for m in layer.modules():
        for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
            v = getattr(m, attr, None)
            if isinstance(v, int) and v > 1:
                counts.add(v)
    return counts


_READS = re.compile(r"self\.((?:\w+\.)*\w+)\.weight\b")


@functools.cache
def _reads_of(cls) -> frozenset[str]:
    try:
        return frozenset(_READS.findall(inspect.getsource(cls.forward)))
    except (OSError, TypeError):
        return frozenset()


def _weights_read(layer: nn.Module) -> set[str]:
    """The linear maps whose `.weight` a module's forward reads itself, its own or a descendant's
    (DeepSeek-V3.2's indexer casts its input to `weights_proj.weight.dtype`, a projection GLM-5
    keeps in fp32; Ergo's decoder layer to `self_attn.o_proj.weight.dtype`): they stay in the
    compute dtype, where the weight is a tensor."""
    out = set()
    for name, m in layer.named_modules():
        for path in _reads_of(type(m)):
            try:
                target = m.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(target, nn.Module):
                out.add(f"{name}.{path}" if name else path)
    return out


def _plain_linear(mod: nn.Linear) -> bool:
    """Whether a linear module computes x W^T (+ b), as QLinear does: nn.Linear's own forward, or a
    subclass's that maps one row of in_features to one of out_features in the input's dtype
    (Falcon's, which adds its bias apart), tried on one row where its weight lies (on `meta` while
    the engine plans: nothing is computed). DeepSeek-V4's grouped projection splits its input into
    groups of in_features, and Ergo's router-style linear returns fp32: both stay as they are."""
    if type(mod).forward is nn.Linear.forward:
        return True
    w = mod.weight
    x = torch.zeros((1, mod.in_features), dtype=w.dtype if w.dtype.is_floating_point else torch.float32,
                    device=w.device)
    try:
        with torch.no_grad():
            y = type(mod).forward(mod, x)
    except Exception:  # noqa: BLE001 -- a row of in_features is not its input
        return False
    return isinstance(y, torch.Tensor) and tuple(y.shape) == (1, mod.out_features) and y.dtype == x.dtype


def quantizable(layer: nn.Module, mode: str) -> dict[str, tuple[nn.Module, bool]]:
    """Sub-module name -> (linear module, is_gpt2_conv1d) for every linear map of a decoder layer
    that `mode` can hold. GPT-2's Conv1D stores W as [in, out]; it is transposed when quantised."""
    from transformers.pytorch_utils import Conv1D

    out = {}
    experts = _expert_counts(layer)
    read = _weights_read(layer)
    for name, mod in layer.named_modules():
        if name in read:
            continue  # its module reads its `.weight` (see _weights_read)
        if isinstance(mod, nn.Linear):
            if not _plain_linear(mod):
                continue  # a subclass with maths of its own (DeepSeek-V4's grouped output projection)
            if mod.out_features in experts and mod.out_features < mod.in_features:
                continue  # a router: see _expert_counts
            k, n = mod.in_features, mod.out_features
            conv = False
        elif isinstance(mod, Conv1D):
            k, n = mod.weight.shape
            conv = True
        else:
            continue
        if mode == "int4" and int4_group_for(k) is None:
            continue  # widths without a supported group stay in the compute dtype
        if mode == "int4" and not torch_int4_fits(n):
            continue
        out[name] = (mod, conv)
    return out


def replace_linears(layer: nn.Module, mode: str, group: int = 128) -> dict[str, tuple]:
    """Swap the layer's linear maps for QLinear modules (empty); name -> (QLinear, conv, old module)."""
    made = {}
    for name, (mod, conv) in quantizable(layer, mode).items():
        if conv:
            k, n = mod.weight.shape
        else:
            n, k = mod.out_features, mod.in_features
        g = int4_group_for(k, group) if mode == "int4" else 0
        q = QLinear(k, n, mode, g, has_bias=getattr(mod, "bias", None) is not None)
        parent_name, _, attr = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, attr, q)
        made[name] = (q, conv, mod)
    return made
