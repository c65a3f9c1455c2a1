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

Layers that keep recurrent states instead of keys and values (state-space, linear attention, short
convolutions) read and write them here too, from per-slot tensors (`states.StateSlots`). Such a layer
runs every row's tokens in one recurrence, so a step gives it rows of one length only (no padding,
no packing: generic.py runs a step's rows in groups of equal lengths), starting at slot `first`.
"""
from __future__ import annotations

import torch

from ..hf.kv_layout import caching_layers, index_key as index_key_of, kv_token_bytes, layer_kv_geometry, measured
from ..storage import BudgetError
from ..units import fmt_bytes
from .states import StateSlots


def kv_bytes(config, slots: int, max_len: int, dtype: torch.dtype, kv_layers: set[int] | None = None) -> int:
    """Bytes of the KV cache; with `kv_layers`, of those layers' only (a hybrid's recurrent layers
    keep none)."""
    if kv_layers is not None and not kv_layers:
        return 0
    width = kv_token_bytes(config, None if kv_layers is None else sorted(kv_layers),
                           torch.empty((), dtype=dtype).element_size())
    return slots * width * (max_len + 1)


class SlotKVCache:
    def __init__(self, config, slots: int, max_len: int, dtype: torch.dtype, device=None, states=None,
                 kv_layers: set[int] | None = None):
        layers = config.num_hidden_layers
        self.slots, self.max_len, self.dtype = slots, max_len, dtype
        self.device = torch.device(device or "cpu")
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        # sparse attention's indexer keys (DeepSeek-V3.2's DSA: one key a token, which picks the
        # keys each query attends to), a layer's beside its latent keys and values
        self.ik: list[torch.Tensor | None] = [None] * layers
        if kv_layers is None or kv_layers:
            rec = measured(config)  # what the model's layers write (hf.kv_layout)
            for i in caching_layers(config, None if kv_layers is None else sorted(kv_layers), rec):
                (kh, kd), (vh, vd) = layer_kv_geometry(config, i, rec)  # layers may differ (Gemma 4's global ones)
                # One spare position per slot: queries that only pad a row write there, never over real keys.
                self.k[i] = torch.zeros((slots, kh, max_len + 1, kd), dtype=dtype, device=device)
                self.v[i] = torch.zeros((slots, vh, max_len + 1, vd), dtype=dtype, device=device)
                index_key = index_key_of(config, i, rec)
                if index_key:
                    self.ik[i] = torch.zeros((slots, max_len + 1, index_key), dtype=dtype, device=device)
        self.indexed = any(t is not None for t in self.ik)
        self.nbytes = kv_bytes(config, slots, max_len, dtype, kv_layers)
        self._rows = 0
        self._write_pos: torch.Tensor | None = None
        self._single: int | None = None
        self._kv_len = 0
        self._write_slot: torch.Tensor | None = None
        self.segments: list[tuple[int, int, int]] | None = None  # packed: (offset, tokens, keys) a row
        self.bytes_read = 0  # KV bytes the attention read, for the bandwidth report
        # recurrent layers' states (a list of states.StateShape from states.probe), or None
        self.states = StateSlots(states, slots, dtype, device) if states else None
        if self.states:
            self.nbytes += self.states.nbytes
        self._first = 0          # the step's rows are slots first .. first + rows - 1
        self._fresh = True       # every row of the step starts a sequence (no state to continue)
        self._past = 0           # positions the step's rows held before it (one value where they agree)

    # ---- the step's geometry ------------------------------------------------------------
    def begin_step(self, starts: list[int], lengths: list[int], window: int | None = None,
                   sliding_layers: bool = False, packed: bool = False, first: int = 0,
                   chunk: int | None = None, chunk_layers: bool = False):
        """Row b (slot first + b) holds `starts[b]` positions and appends `lengths[b]` new tokens
        this step. Returns (position_ids [B, Q], attention mask [B, 1, Q, L] or a dict of them);
        packed, the rows' tokens side by side as one row: position_ids [1, T] and masks [1, 1, T, L]."""
        rows, q = len(starts), max(lengths)
        if first + rows > self.slots:
            raise BudgetError(f"{first + rows} sequences in a step but the KV cache has {self.slots} slots")
        if first and packed:
            raise ValueError("a packed step starts at slot 0")
        self._first = first
        self._past = min(starts)
        if self.states:  # a sequence starting in a slot starts from zero states, whatever was there
            self.states.zero([first + b for b, s in enumerate(starts) if s == 0])
            self._fresh = not any(starts)
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

        dev = self.device
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
        if chunk is not None:  # a query sees its own chunk's keys, up to itself
            chunked = full & (k // chunk == pos[:, :, None] // chunk)
            if not chunk_layers:
                masks = chunked
            else:
                if not isinstance(masks, dict):
                    masks = {"full_attention": masks[:, None]}
                masks["chunked_attention"] = chunked[:, None]
        if not isinstance(masks, dict):
            masks = masks[:, None]
        return pos, masks

    # ---- what the attention layers call ---------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        b, h, q, d = key.shape
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if kc is None:
            raise RuntimeError(f"layer {layer_idx} attends, but the model's modules showed no attention there when "
                               f"the KV cache was made (a tierlm bug: please report it with the model's config.json)")
        if h != kc.shape[1]:
            kc, vc = self._fit_heads(layer_idx, h)
        if self._write_slot is not None:  # packed: token t goes to its row's slot
            slot, pos = self._write_slot, self._write_pos
            kc[slot, :, pos] = key[0].transpose(0, 1).to(kc.dtype)
            vc[slot, :, pos] = value[0].transpose(0, 1).to(vc.dtype)
            b = self._rows
        elif self._single is not None and b == 1:
            s, f = self._single, self._first
            kc[f, :, s:s + q].copy_(key[0])
            vc[f, :, s:s + q].copy_(value[0])
        else:
            f = self._first
            slot = torch.arange(f, f + b, device=kc.device)[:, None, None]
            head = torch.arange(h, device=kc.device)[None, :, None]
            pos = self._write_pos[:, None, :]
            kc[slot, head, pos] = key.to(kc.dtype)
            vc[slot, head, pos] = value.to(vc.dtype)
        L, f = self._kv_len, self._first
        self.note_read(b, layer_idx)
        return kc[f:f + b, :, :L], vc[f:f + b, :, :L]

    def update_indexer(self, key: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """A sparse-attention indexer's keys ([rows, tokens, dim]): written at each row's positions
        as `update` writes keys; the rows' keys so far returned ([rows, L, dim]; positions past a
        row's end are hidden by the step's mask, which the indexer applies before its top-k)."""
        ic = self.ik[layer_idx]
        if ic is None:
            raise RuntimeError(f"layer {layer_idx}'s attention keeps indexer keys, but the model's config gave no "
                               f"index_head_dim when the KV cache was made (a tierlm bug: please report it with "
                               f"the model's config.json)")
        b, q, _ = key.shape
        f = self._first
        if self._write_slot is not None:
            raise RuntimeError("a packed step reached a sparse-attention indexer (a tierlm bug: such models run "
                               "their rows padded)")
        if self._single is not None and b == 1:
            s = self._single
            ic[f, s:s + q].copy_(key[0])
        else:
            slot = torch.arange(f, f + b, device=ic.device)[:, None]
            ic[slot, self._write_pos] = key.to(ic.dtype)
        return ic[f:f + b, :self._kv_len]

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
        """The positions held before this step, as transformers' caches answer before their update:
        Llama 4's attention scales its no-rotary layers' queries by position from it. One number for
        all rows, so where a model's attention reads it, a step's rows run in groups of one start
        (GenericStep.groups)."""
        return self._past

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(keys, offset) of a mask transformers makes itself: only where the engine gives none, a
        model with no attention layer (whose masks no layer reads)."""
        return self._kv_len, 0

    # ---- what recurrent layers call (states.py) --------------------------------------------
    # The calls and their meaning are transformers' (cache_utils.LinearAttentionLayer): None where
    # no row has a state to continue (the layer takes its first-prompt path), else the step's rows'
    # slots, a view the layer may update in place (its one-token path does).
    def _state(self, layer: int, index: int, kind: str) -> torch.Tensor:
        if self.states is None:
            raise RuntimeError(f"layer {layer} keeps a {kind} state but the cache was made without state slots "
                               f"(a tierlm bug: please report it with the model's config.json)")
        t = self.states.get(layer, index, kind)
        return t[self._first:self._first + self._rows]

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return not self._fresh

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """How many of a prompt's intermediate states a recurrence hands `update_recurrent_state`
        (transformers 5.25, for rolling back speculative tokens): none, the last one only."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """A one-token convolution step updated its state in place (transformers 5.25 counts the
        cache's tokens there); the engine counts positions itself."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None if self._fresh else self._state(layer_idx, state_idx, "conv")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return None if self._fresh else self._state(layer_idx, state_idx, "recurrent")

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """Keep each row's last `kernel` inputs; return them with the new ones, the left context the
        layer's causal convolution runs over (zeros before a sequence's first token)."""
        kept = self._state(layer_idx, state_idx, "conv")
        k = kept.shape[-1]
        if self._fresh:
            full = conv_states
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0))
        else:
            full = torch.cat([kept.to(conv_states.dtype), conv_states], dim=-1)
        kept.copy_(full[..., -k:])
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        kept = self._state(layer_idx, state_idx, "recurrent")
        # a list: the prompt's last intermediate states (none asked: get_recurrent_states_to_keep),
        # the final one last
        kept.copy_(recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1])
        return kept

    # ---- slots --------------------------------------------------------------------------
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` positions into slot dst (compaction after a finish)."""
        for kc, vc, ic in zip(self.k, self.v, self.ik):
            if kc is None:
                continue
            kc[dst, :, :length].copy_(kc[src, :, :length])
            vc[dst, :, :length].copy_(vc[src, :, :length])
            if ic is not None:
                ic[dst, :length].copy_(ic[src, :length])
        if self.states:
            self.states.move(src, dst)

    def check_fits(self, positions: int, what: str = "the request") -> None:
        if positions > self.max_len:
            raise BudgetError(
                f"{what} needs {positions} positions (prompt + max tokens) but each KV cache slot holds "
                f"{self.max_len}; shorten it or raise --max-seq-len (cache: {self.slots} slots, "
                f"{fmt_bytes(self.nbytes)})")
