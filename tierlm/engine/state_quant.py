"""Compressed Adam moments: bf16, or 8-bit block-wise dynamic quantisation.

The 8-bit format follows Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2022):
each block of BLOCK elements is normalised by its own absolute maximum (one fp32 per block), and
the normalised value in [-1, 1] is stored as the index of the nearest entry of a 256-entry
*dynamic (tree) map*. The map spends its codes on every decade from 1e-6 to 1 (a float-like
exponent with a shrinking fraction), so the small values that dominate Adam's moments keep a few
significant bits instead of rounding to zero as a linear 8-bit grid would. m is signed, v (a mean
of squares) is never negative: its map spends the sign bit on a finer fraction.

Block-wise normalisation keeps one outlier from flattening a whole tensor, and makes the format
local: a shard whose size is a multiple of BLOCK quantises exactly as the same elements of the
whole tensor would, so the out-of-core optimizer's sharding does not change a bit.

Stored layouts of one shard of n elements (one file per moment):
    fp32  float32[n]
    bf16  bfloat16[n]                   (round to nearest even)
    int8  uint8[4 * ceil(n / BLOCK) + n] (the per-block fp32 absmax, then the n codes)
"""
from __future__ import annotations

import torch

from ..plan.budget import BLOCK, MODES, check_mode, moment_bytes_per_param  # noqa: F401  (the format's sizes)
# Work on this many elements at a time: the temporaries stay small whatever the shard size (outside
# the optimizer's buffer pool), and every op stays within ATen's 32768-element grain, so it runs on
# the optimizer's own thread instead of waking the OpenMP pool that backward is using (on a busy
# 2-core machine that contention made a 4M-element quantisation 10x slower).
_CHUNK = 1 << 15


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted values of the dynamic tree map (max 7 exponent bits, 8 bits in all).

    Decade i (i = 0..6) covers [0.1, 1] x 10^(i-6) with 2^i (signed) or 2^(i+1) (unsigned)
    fraction values: the midpoints of an even split of [0.1, 1]; the bigger the value, the more
    fraction bits. With 0 and 1 added that is 127 x 2 + 2 (signed) or 254 + 2 (unsigned) codes.
    """
    vals = [0.0, 1.0]
    for i in range(7):
        parts = 2 ** i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, parts + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        vals += mids
        if signed:
            vals += [-x for x in mids]
    assert len(vals) == 256
    return torch.tensor(sorted(vals), dtype=torch.float32)


class _Map:
    """Nearest-entry search by table instead of a binary search (bucketize is ~75 ns an element).

    The code of y is the number of midpoints between map entries below y (what bucketize returns).
    y's float32 bits, turned into an integer of the same order, select a cell of a table by their
    top bits; the cell stores how many midpoints lie below its start, and the at most `spread`
    midpoints inside it are compared with y directly. Same answer as bucketize for every float.
    """

    SHIFT = 15  # 2^17 cells: a cell is 2^-8 of a binade, finer than the map's closest entries

    def __init__(self, signed: bool):
        self.values = dynamic_map(signed)
        # a value exactly on a midpoint goes to the lower entry (bucketize's right=False)
        self.bounds = (self.values[:-1] + self.values[1:]) / 2
        half = 1 << (31 - self.SHIFT)
        keys = (torch.arange(2 * half, dtype=torch.int64) - half) << self.SHIFT
        starts = _unorder(keys.to(torch.int32)).view(torch.float32)
        base = torch.searchsorted(self.bounds, starts.nan_to_num(nan=0.0))
        base[torch.isnan(starts)] = 0  # only NaN input lands there; any code will do
        finite = ~torch.isnan(starts)
        nxt = torch.cat([base[1:], base[-1:]])
        self.spread = int((nxt - base)[finite].max())
        self.base = base.to(torch.int32)
        self.padded = torch.cat([self.bounds, torch.full((self.spread,), float("inf"))])

    def codes(self, y: torch.Tensor, out: torch.Tensor) -> None:
        """out (uint8) = bucketize(y, bounds) for a flat fp32 y (a chunk: the temporaries are y's size)."""
        bits = y.view(torch.int32)
        cell = bits >> 31
        cell &= 0x7FFFFFFF
        cell ^= bits  # now ordered like the floats
        cell >>= self.SHIFT
        cell += 1 << (31 - self.SHIFT)
        idx = torch.index_select(self.base, 0, cell)
        code = idx.clone()
        for k in range(self.spread):
            if k:
                idx += 1
            code += torch.index_select(self.padded, 0, idx) < y
        out.copy_(code)


def _order(bits: torch.Tensor) -> torch.Tensor:
    """float32 bits (as int32) -> an int32 with the floats' order (negative floats reversed)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


_unorder = _order  # the mapping is its own inverse


_MAPS = {True: _Map(True), False: _Map(False)}


def n_blocks(n: int, block: int = BLOCK) -> int:
    return (n + block - 1) // block


def _scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block absmax of a flat fp32 tensor (a partial last block has its own)."""
    n = x.numel()
    full = n // block
    out = torch.empty(n_blocks(n, block), dtype=torch.float32)
    if full:
        torch.amax(x[:full * block].view(full, block).abs(), dim=1, out=out[:full])
    if n > full * block:
        out[full] = x[full * block:].abs().max()
    return out


def _blockwise(n: int, block: int):
    """(start, end, first block) of the chunks of a flat tensor; chunks are whole blocks."""
    if _CHUNK % block:
        raise ValueError(f"block size {block} must divide {_CHUNK}")
    for a in range(0, n, _CHUNK):
        yield a, min(a + _CHUNK, n), a // block


def _per_block(t: torch.Tensor, scale: torch.Tensor, block: int, op) -> None:
    """op(t_rows, scale_column) in place over t's full blocks, then the partial last block."""
    n = t.numel()
    full = n // block
    if full:
        op(t[:full * block].view(full, block), scale[:full].view(full, 1))
    if n > full * block:
        op(t[full * block:], scale[full:full + 1])


def quantize_blockwise(x: torch.Tensor, signed: bool, block: int = BLOCK,
                       codes: torch.Tensor | None = None, absmax: torch.Tensor | None = None):
    """(codes uint8[n], absmax float32[n_blocks]) of a flat fp32 tensor: code = the nearest map
    entry to x / absmax of x's block. An all-zero block has absmax 0 and codes of 0.0."""
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"quantize_blockwise takes a flat float32 tensor, got {x.dtype}{list(x.shape)}")
    qmap = _MAPS[signed]
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8) if codes is None else codes
    absmax = _scales(x, block) if absmax is None else absmax.copy_(_scales(x, block))
    # A zero block divides by 1 instead (0/1 = 0 is the code of 0.0, no NaN).
    scale = torch.where(absmax > 0, absmax, torch.ones((), dtype=torch.float32))
    normed = torch.empty(min(n, _CHUNK), dtype=torch.float32)
    for a, b, blk in _blockwise(n, block):
        y = normed[:b - a]
        y.copy_(x[a:b])
        _per_block(y, scale[blk:], block, lambda rows, s: rows.div_(s))
        qmap.codes(y, codes[a:b])
    return codes, absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
                         block: int = BLOCK, out: torch.Tensor | None = None) -> torch.Tensor:
    """map[code] * absmax of the block, as float32."""
    n = codes.numel()
    if absmax.numel() != n_blocks(n, block):
        raise ValueError(f"{n} codes need {n_blocks(n, block)} block scales, got {absmax.numel()}")
    values = _MAPS[signed].values
    out = torch.empty(n, dtype=torch.float32) if out is None else out
    for a, b, blk in _blockwise(n, block):
        torch.index_select(values, 0, codes[a:b].int(), out=out[a:b])
        _per_block(out[a:b], absmax[blk:], block, lambda rows, s: rows.mul_(s))
    return out


# ---- the stored form of one moment shard ------------------------------------------------

def stored_spec(mode: str, n: int) -> tuple[torch.dtype, int]:
    """(dtype, numel) of a moment shard of n elements as stored."""
    if mode == "fp32":
        return torch.float32, n
    if mode == "bf16":
        return torch.bfloat16, n
    return torch.uint8, 4 * n_blocks(n) + n


def stored_nbytes(mode: str, n: int) -> int:
    dt, numel = stored_spec(mode, n)
    return numel * torch.empty((), dtype=dt).element_size()


def encode(mode: str, x: torch.Tensor, stored: torch.Tensor, signed: bool) -> None:
    """Write the fp32 moment x (flat) into `stored` (a tensor of stored_spec(mode, x.numel()))."""
    if mode == "int8":
        nb = n_blocks(x.numel())
        quantize_blockwise(x, signed, codes=stored[4 * nb:], absmax=stored[:4 * nb].view(torch.float32))
    else:
        stored.copy_(x)  # bf16: round to nearest even


def decode(mode: str, stored: torch.Tensor, out: torch.Tensor, signed: bool) -> None:
    """The fp32 moment from its stored form, into `out` (flat, n elements)."""
    if mode == "int8":
        nb = n_blocks(out.numel())
        dequantize_blockwise(stored[4 * nb:], stored[:4 * nb].view(torch.float32), signed, out=out)
    else:
        out.copy_(stored)  # bf16 -> fp32 is exact


__all__ = ["BLOCK", "MODES", "check_mode", "decode", "dequantize_blockwise", "dynamic_map", "encode",
           "moment_bytes_per_param", "n_blocks", "quantize_blockwise", "stored_nbytes", "stored_spec"]
