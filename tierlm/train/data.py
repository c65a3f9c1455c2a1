"""Fine-tuning data: read JSONL / text files, tokenise everything up front, pack into fixed-length rows.

Everything is validated and tokenised in `load_dataset`, before the first training step, so a bad
line 90,000 of a file fails in seconds rather than hours into a run. Token ids are small compared
with the model, so the whole tokenised corpus is held as one flat int32 array plus a bool "trained"
mask; rows are views into it.

Accepted inputs (a file, or a folder searched recursively in sorted path order):
  *.jsonl / *.json   JSON Lines, one record per line:
                       {"text": ...}                         every token trained
                       {"prompt": ..., "completion": ...}    prompt masked, completion + EOS trained
                       {"messages": [{"role", "content"}]}   chat template; assistant turns trained
  anything else      one UTF-8 text document, every token trained (in a folder: .txt .md .markdown
                     .rst .text only, so stray binaries next to the data are skipped, not fatal)

Each document is framed as [BOS] tokens [EOS] so packed neighbours are separated. Labels follow the
HF convention: labels == input_ids with untrained positions set to -100; the model shifts them.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .data_formats import (ACCEPTED_RECORDS, JSONL_SUFFIXES, SKIPPED_SHOWN, TEXT_SUFFIXES, DataError,
                           _files, _jsonl_pieces, _read_text, _text_pieces)
from .data_packing import IGNORE_INDEX, PackedDataset, _Encoder

__all__ = ["ACCEPTED_RECORDS", "Batches", "DataError", "IGNORE_INDEX", "JSONL_SUFFIXES", "PackedDataset",
           "SKIPPED_SHOWN", "TEXT_SUFFIXES", "load_dataset"]

log = logging.getLogger(__name__)

_BATCH_CHARS = 1 << 22        # flush the encode batch at this many characters ...
_BATCH_PIECES = 1024          # ... or this many pieces


def load_dataset(path: str | os.PathLike, tokenizer, seq_len: int) -> PackedDataset:
    """Read, validate and tokenise all data under `path`, then pack it into rows of `seq_len` tokens."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"--seq-len must be an integer >= 2, got {seq_len!r}.")
    path = Path(path)
    files, skipped = _files(path)
    enc = _Encoder(tokenizer)
    for f in files:
        text = _read_text(f)
        pieces = _jsonl_pieces(f, text, tokenizer) if f.suffix.lower() in JSONL_SUFFIXES else _text_pieces(f, text)
        batch, chars = [], 0
        for p in pieces:
            batch.append(p); chars += len(p.text)
            if len(batch) >= _BATCH_PIECES or chars >= _BATCH_CHARS:
                enc.add(batch); batch, chars = [], 0
        enc.add(batch)
        log.info("%s: tokenised, %d tokens so far", f, len(enc.ids))
    ids = torch.frombuffer(enc.ids, dtype=torch.int32).clone() if enc.ids else torch.zeros(0, dtype=torch.int32)
    trained = torch.frombuffer(enc.mask, dtype=torch.int8).bool() if enc.mask else torch.zeros(0, dtype=torch.bool)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else enc.eos
    ds = PackedDataset(ids, trained, seq_len, pad, enc.documents, len(files), str(path), skipped)
    log.info("data: %s", ds.summary())
    return ds


# ---------------------------------------------------------------------------------------------- batches

class Batches:
    """Endless, resumable stream of batches `(input_ids [B, T], labels [B, T])` over a PackedDataset.

    Order: epoch e visits every row once, in `torch.randperm(len(dataset))` drawn from a CPU
    torch.Generator seeded with `seed + e` (row order 0..N-1 when shuffle=False), in consecutive
    slices of `batch_size`. The last batch of an epoch is smaller unless `drop_last`, which skips the
    remainder instead. Epochs follow each other forever; stop by counting steps.

    The position (`epoch`, `index` = rows of epoch `epoch` already consumed) always points at the next
    batch. Save `state_dict()` after the step that consumed a batch; `load_state_dict` on a fresh Batches
    over the same data resumes with exactly the next sample (even if batch_size changed).
    """

    def __init__(self, dataset: PackedDataset, batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch size must be a positive integer, got {batch_size!r}.")
        if drop_last and batch_size > len(dataset):
            raise DataError(f"batch size {batch_size} is larger than the dataset ({len(dataset)} rows) and "
                            f"drop_last is set, so no batch could be formed. Use a smaller batch size or "
                            f"--seq-len, or more data.")
        self.dataset, self.batch_size, self.seed, self.shuffle, self.drop_last = (
            dataset, batch_size, seed, shuffle, drop_last)
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> torch.Tensor:
        """Row indices in the order epoch `epoch` visits them."""
        if epoch != self._order_epoch:
            n = len(self.dataset)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(n, generator=g)
            else:
                self._order = torch.arange(n)
            self._order_epoch = epoch
        return self._order

    def _normalise(self) -> None:
        n = len(self.dataset)
        if self.index >= n or (self.drop_last and self.index + self.batch_size > n):
            self.epoch, self.index = self.epoch + 1, 0

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._normalise()
        rows = self.order(self.epoch)[self.index: self.index + self.batch_size].tolist()
        self.index += len(rows)
        self._normalise()
        ids, labels = zip(*(self.dataset[r] for r in rows))
        return torch.stack(ids), torch.stack(labels)

    def peek(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch `next` returns, without taking it (the position stays)."""
        epoch, index = self.epoch, self.index
        try:
            return next(self)
        finally:
            self.epoch, self.index = epoch, index

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": len(self.dataset), "seq_len": self.dataset.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("num_rows", len(self.dataset)), ("seq_len", self.dataset.seq_len),
                          ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise DataError(f"cannot resume the data position: the checkpoint was saved with {key}="
                                f"{state[key]!r} but this run has {key}={mine!r}. Resume with the same data, "
                                f"--seq-len and seed, or start a fresh run.")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self.dataset):
            raise DataError(f"invalid data position epoch={epoch}, index={index} in the checkpoint.")
        self.epoch, self.index = epoch, index
        self._normalise()
