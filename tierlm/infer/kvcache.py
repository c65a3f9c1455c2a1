"""The KV cache: preallocated slots, one per sequence in the batch, inside the `cpu` budget.

Allocated (and touched) once, so its bytes are in RSS from the start and a request can never
grow the process past its budget: a request that needs more positions than a slot has is refused
before it runs. Slots in use are kept compact (0..B-1) so a step reads `cache[:B, :, :L]` as a
view, not a gathered copy; a finishing sequence's slot is filled by moving the last one into it.

The object is what transformers' attention layers call `past_key_values.update(k, v, layer)` on.
Each row writes its new keys at its own positions (continuous batching: the sequences in a batch
have different lengths), and the step's 4-D mask (built here too) hides what a row must not see.
A packed step (`tierlm.infer.packed`) feeds the rows' tokens as one row: each token's keys go to
its own slot and `segments` tells the attention which tokens are whose.
"""
from __future__ import annotations

import torch

from ..hf.fields import kv_geometry
from ..storage import BudgetError
from ..units import fmt_bytes


def cache_kwarg(model) -> str:
    """The keyword `model.forward` takes the KV cache by: `cache` in the transformers that renamed
    it (where `past_key_values` still works but warns on every call, in the middle of a chat's
    output), `past_key_values` in those before."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_bytes(config, slots: int, max_len: int, dtype: torch.dtype) -> int:
    layers, (kh, kd), (vh, vd) = kv_geometry(config)
    return layers * slots * (kh * kd + vh * vd) * (max_len + 1) * torch.empty((), dtype=dtype).element_size()


class SlotKVCache:
    def __init__(self, config, slots: int, max_len: int, dtype: torch.dtype, device=None):
        layers, (kh, kd), (vh, vd) = kv_geometry(config)
        self.slots, self.max_len, self.dtype = slots, max_len, dtype
        # One spare position per slot: queries that only pad a row write there, never over real keys.
        self.k = [torch.zeros((slots, kh, max_len + 1, kd), dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros((slots, vh, max_len + 1, vd), dtype=dtype, device=device) for _ in range(layers)]
        self.nbytes = kv_bytes(config, slots, max_len, dtype)
        self._rows = 0
        self._write_pos: torch.Tensor | None = None
        self._single: int | None = None
        self._kv_len = 0
        self._write_slot: torch.Tensor | None = None
        self.segments: list[tuple[int, int, int]] | None = None  # packed: (offset, tokens, keys) a row
        self.bytes_read = 0  # KV bytes the attention read, for the bandwidth report

    # ---- the step's geometry ------------------------------------------------------------
    def begin_step(self, starts: list[int], lengths: list[int], window: int | None = None,
                   sliding_layers: bool = False, packed: bool = False):
        """Row b (slot b) holds `starts[b]` positions and appends `lengths[b]` new tokens this
        step. Returns (position_ids [B, Q], attention mask [B, 1, Q, L] or a dict of them); packed,
        the rows' tokens side by side as one row: position_ids [1, T] and masks [1, 1, T, L]."""
        rows, q = len(starts), max(lengths)
        if rows > self.slots:
            raise BudgetError(f"{rows} sequences in a step but the KV cache has {self.slots} slots")
        ends = [s + n for s, n in zip(starts, lengths)]
        if max(ends) > self.max_len:
            raise BudgetError(f"a sequence reached {max(ends)} positions; the KV cache holds {self.max_len}")
        self._rows = rows
        self._kv_len = max(ends)
        self.segments = None
        self._write_slot = None
        if packed:
            pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])[None, :]
            self._write_pos = pos[0]
            self._write_slot = torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths))
            offs = [0]
            for n_ in lengths[:-1]:
                offs.append(offs[-1] + n_)
            self.segments = list(zip(offs, lengths, ends))
            self._single = None
        else:
            start = torch.tensor(starts)[:, None]
            n = torch.tensor(lengths)[:, None]
            j = torch.arange(q)[None, :]
            real = j < n
            pos = start + torch.minimum(j, n - 1)           # padding repeats the row's last position
            self._write_pos = torch.where(real, start + j, torch.full_like(j, self.max_len))
            # one row has no padding: its keys go to a contiguous range, a slice copy, not index_put
            self._single = starts[0] if rows == 1 else None
        dev = self.k[0].device
        if dev.type != "cpu":  # a GPU's cache: the step's write indices copied there once, not once a layer
            self._write_pos = self._write_pos.to(dev)
            self._write_slot = None if self._write_slot is None else self._write_slot.to(dev)
        k = torch.arange(self._kv_len)[None, None, :]
        full = k <= pos[:, :, None]
        masks = full
        if window is not None:
            slide = full & (k > pos[:, :, None] - window)
            masks = {"full_attention": full[:, None], "sliding_attention": slide[:, None]} if sliding_layers \
                else slide
        if not isinstance(masks, dict):
            masks = masks[:, None]
        return pos, masks

    # ---- what the attention layers call ---------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        b, h, q, d = key.shape
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if h != kc.shape[1]:
            kc, vc = self._fit_heads(layer_idx, h)
        if self._write_slot is not None:  # packed: token t goes to its row's slot
            slot, pos = self._write_slot, self._write_pos
            kc[slot, :, pos] = key[0].transpose(0, 1).to(kc.dtype)
            vc[slot, :, pos] = value[0].transpose(0, 1).to(vc.dtype)
            b = self._rows
        elif self._single is not None and b == 1:
            s = self._single
            kc[0, :, s:s + q].copy_(key[0])
            vc[0, :, s:s + q].copy_(value[0])
        else:
            slot = torch.arange(b, device=kc.device)[:, None, None]
            head = torch.arange(h, device=kc.device)[None, :, None]
            pos = self._write_pos[:, None, :]
            kc[slot, head, pos] = key.to(kc.dtype)
            vc[slot, head, pos] = value.to(vc.dtype)
        L = self._kv_len
        self.note_read(b, layer_idx)
        return kc[:b, :, :L], vc[:b, :, :L]

    def _fit_heads(self, layer_idx: int, heads: int):
        """The config's KV head count is not always what the attention writes: Falcon's multi-query
        attention (new_decoder_architecture off) writes one head where its config says as many as
        the queries. Fewer heads than planned: this layer's cache shrinks to them (on its first
        write; the budget planned the larger one). More would not fit the budget."""
        kc = self.k[layer_idx]
        if heads > kc.shape[1]:
            raise RuntimeError(f"layer {layer_idx}'s attention writes {heads} key/value heads but the KV cache "
                               f"was planned for {kc.shape[1]} from the model's config (a tierlm bug: please "
                               f"report it with the model's config.json)")
        vc = self.v[layer_idx]
        old = (kc.numel() + vc.numel()) * kc.element_size()
        kw = dict(dtype=kc.dtype, device=kc.device)
        self.k[layer_idx] = torch.zeros((kc.shape[0], heads) + tuple(kc.shape[2:]), **kw)
        self.v[layer_idx] = torch.zeros((vc.shape[0], heads) + tuple(vc.shape[2:]), **kw)
        self.nbytes -= old - (self.k[layer_idx].numel() + self.v[layer_idx].numel()) * kc.element_size()
        return self.k[layer_idx], self.v[layer_idx]

    def note_read(self, rows: int, layer_idx: int, layers: int = 1) -> None:
        """Count the KV bytes a layer's attention reads this step (for the bandwidth report); with
        `layers`, as much for that many layers (every layer's cache has the same shape)."""
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        keys = sum(e for _, _, e in self.segments) if self.segments else rows * self._kv_len  # packed rows read to their end
        self.bytes_read += keys * (kc.shape[1] * kc.shape[3] + vc.shape[1] * vc.shape[3]) * kc.element_size() * layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    # ---- slots --------------------------------------------------------------------------
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` positions into slot dst (compaction after a finish)."""
        for kc, vc in zip(self.k, self.v):
            kc[dst, :, :length].copy_(kc[src, :, :length])
            vc[dst, :, :length].copy_(vc[src, :, :length])

    def check_fits(self, positions: int, what: str = "the request") -> None:
        if positions > self.max_len:
            raise BudgetError(
                f"{what} needs {positions} positions (prompt + max tokens) but each KV cache slot holds "
                f"{self.max_len}; shorten it or raise --max-seq-len (cache: {self.slots} slots, "
                f"{fmt_bytes(self.nbytes)})")
