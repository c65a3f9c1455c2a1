"""Tokenising the pieces read (train/data_formats.py) into one flat id array and a trained mask,
documents framed by BOS/EOS, and packing them into fixed-length rows (PackedDataset)."""
from __future__ import annotations

import bisect
from array import array

import torch

from ..units import count
from .data_formats import DataError, _Piece, _skipped_text

IGNORE_INDEX = -100


class _Encoder:
    """Batch-encodes pieces into the flat id / trained-mask arrays, framing documents with BOS/EOS."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise DataError("the tokenizer has no EOS token, so packed documents cannot be separated. "
                            "Use a tokenizer/model that defines eos_token.")
        bos = tokenizer.bos_token_id
        # BOS == EOS (GPT-2 style) would just double the separator.
        self.bos = bos if bos is not None and bos != self.eos else None
        self.fast = bool(getattr(tokenizer, "is_fast", False))
        self.ids, self.mask = array("i"), array("b")
        self.documents = 0

    def _encode(self, texts: list[str], offsets: bool) -> tuple[list[list[int]], list | None]:
        enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=offsets, verbose=False)
        return enc["input_ids"], (enc["offset_mapping"] if offsets else None)

    def add(self, pieces: list[_Piece]) -> None:
        if not pieces:
            return
        if self.fast:
            # Offsets cost as much as the ids to convert, so only the partly masked pieces ask for them.
            ids, masks = [None] * len(pieces), [None] * len(pieces)
            for partial in (False, True):
                ks = [k for k, p in enumerate(pieces) if (p.spans is not None) == partial]
                if ks:
                    got, offs = self._encode([pieces[k].text for k in ks], partial)
                    for n, k in enumerate(ks):
                        ids[k] = got[n]
                        masks[k] = self._mask_from_offsets(pieces[k].spans, offs[n]) if partial else [1] * len(got[n])
        else:
            ids, masks = self._encode_segments(pieces)
        for p, i, m in zip(pieces, ids, masks):
            self._append(p, i, m)

    @staticmethod
    def _mask_from_offsets(spans, offsets) -> list[int]:
        # A token is trained if it overlaps a trained span: a token straddling the boundary carries trained
        # characters, and the model must produce it to produce them. Offsets are ordered, so bisect.
        mask = [0] * len(offsets)
        for a, b in spans:
            i = bisect.bisect_left(offsets, a + 1, key=lambda o: max(o[1], o[0] + 1))    # first ending after a
            j = bisect.bisect_left(offsets, b, key=lambda o: o[0])                      # first starting at/after b
            mask[i:j] = [1] * max(j - i, 0)
        return mask

    def _encode_segments(self, pieces: list[_Piece]):
        # Slow tokenizers have no offsets: encode trained and untrained stretches separately instead.
        texts, owner, flags = [], [], []
        for k, p in enumerate(pieces):
            cuts = [(0, len(p.text), 1)] if p.spans is None else []
            if p.spans is not None:
                pos = 0
                for a, b in p.spans:
                    cuts += [(pos, a, 0), (a, b, 1)]
                    pos = b
                cuts.append((pos, len(p.text), 0))
            for a, b, f in cuts:
                if b > a:
                    texts.append(p.text[a:b]); owner.append(k); flags.append(f)
        ids, masks = [[] for _ in pieces], [[] for _ in pieces]
        for k, f, seg in zip(owner, flags, self._encode(texts, False)[0] if texts else []):
            ids[k] += seg; masks[k] += [f] * len(seg)
        return ids, masks

    def _append(self, p: _Piece, ids: list[int], mask: list[int]) -> None:
        if p.bos and self.bos is not None and not (ids and ids[0] == self.bos):  # chat templates may add it
            self.ids.append(self.bos); self.mask.append(0)
        self.ids.extend(ids); self.mask.extend(mask)
        if p.eos:
            if not (ids and ids[-1] == self.eos):
                self.ids.append(self.eos); self.mask.append(int(p.eos_trained))
            self.documents += 1


# ---------------------------------------------------------------------------------------------- dataset

class PackedDataset:
    """Rows of `seq_len` consecutive tokens cut from the concatenated documents.

    `num_tokens` counts real (non-padding) tokens in the kept rows; `num_trainable_tokens` counts the
    positions that produce loss, i.e. labels[1:] != -100 per row (labels[0] is shifted away by the model).
    """

    def __init__(self, ids: torch.Tensor, trained: torch.Tensor, seq_len: int, pad_id: int,
                 documents: int = 0, files: int = 0, source: str = "",
                 skipped: list[tuple[str, str]] | None = None):
        if seq_len < 2:
            raise DataError(f"seq_len must be at least 2, got {seq_len}.")
        n = int(ids.numel())
        if n < 2:
            raise DataError(f"{source}: the data is only {count(n, 'token')} long, too short for even one training "
                            f"row of 2 tokens. Add more data.")
        self.seq_len, self.documents, self.files, self.source = seq_len, documents, files, source
        self.skipped = skipped or []  # (name, why) of files in the data folder that were not read
        self.padded = n < seq_len
        if self.padded:  # the only row: pad at the end (causal attention never looks ahead, no mask needed)
            real = n
            ids = torch.cat([ids, torch.full((seq_len - n,), pad_id, dtype=ids.dtype)])
            trained = torch.cat([trained, torch.zeros(seq_len - n, dtype=torch.bool)])
        else:
            real = n // seq_len * seq_len
            ids, trained = ids[:real], trained[:real]
        self.dropped_tail_tokens = n - real
        self._ids = ids.view(-1, seq_len).clone()
        self._trained = trained.view(-1, seq_len).clone()
        # A row with no target after the shift gives 0/0 = NaN loss, so it is dropped.
        targets = self._trained[:, 1:].sum(dim=1)
        self._rows = torch.nonzero(targets > 0).flatten()
        self.dropped_masked_rows = int(self._ids.shape[0] - self._rows.numel())
        if self._rows.numel() == 0:
            raise DataError(f"{source}: every {seq_len}-token row consists only of masked (prompt/non-assistant) "
                            f"tokens, so there is nothing to train on. Add completions/assistant replies or use a "
                            f"longer --seq-len.")
        self.num_trainable_tokens = int(targets[self._rows].sum())
        self.num_tokens = real - self.dropped_masked_rows * seq_len  # padded => nothing dropped

    def __len__(self) -> int:
        return int(self._rows.numel())

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self._rows[i]
        ids = self._ids[r].long()
        return ids, ids.masked_fill(~self._trained[r], IGNORE_INDEX)

    def summary(self) -> str:
        extra = [f"{count(self.dropped_tail_tokens, 'tail token')} dropped"] if self.dropped_tail_tokens else []
        if self.dropped_masked_rows:
            extra.append(f"{count(self.dropped_masked_rows, 'fully masked row')} dropped")
        if self.padded:
            extra.append("single row padded")
        return (f"{count(self.documents, 'document')} from {count(self.files, 'file')} -> "
                f"{count(len(self), 'row')} x {self.seq_len} tokens: {count(self.num_tokens, 'token')}, "
                f"{self.num_trainable_tokens:,} trained" + (f" ({', '.join(extra)})" if extra else "")
                + (f"; not read: {_skipped_text(self.skipped)}" if self.skipped else ""))

    __str__ = summary
