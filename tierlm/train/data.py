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

import bisect
import json
import logging
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..units import count

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
ACCEPTED_RECORDS = ('{"text": "..."}, {"prompt": "...", "completion": "..."} or '
                    '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}')
_TEXT_PIECE_CHARS = 1 << 18   # long text files are encoded in newline-aligned pieces: bounded memory per call
_BATCH_CHARS = 1 << 22        # flush the encode batch at this many characters ...
_BATCH_PIECES = 1024          # ... or this many pieces


class DataError(ValueError):
    """A problem with the training data or its settings; the message says where and how to fix it."""


@dataclass
class _Piece:
    """Text to encode plus how to frame and mask it. `spans` are trained character ranges (None: all)."""
    text: str
    spans: list[tuple[int, int]] | None
    bos: bool            # first piece of a document
    eos: bool            # last piece of a document
    eos_trained: bool    # the appended EOS is a target (not for chats: their own end marker is)
    where: str


# ---------------------------------------------------------------------------------------------- reading

SKIPPED_SHOWN = 5  # skipped files named in the data line; the rest are counted


def _files(path: Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """The data files under `path`, and what was passed over in a folder: (name, why) each, a hidden
    folder once (not each file in it), so the data line can say what was not read."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder. Check the data path (relative paths are from "
                        f"the current directory, {os.getcwd()}).")
    if path.is_file():
        return [path], []
    found, skipped, hidden = [], [], set()
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        dot = next((i for i, part in enumerate(rel.parts) if part.startswith(".")), None)
        if dot is not None:
            top = Path(*rel.parts[:dot + 1])
            if top not in hidden:
                hidden.add(top)
                skipped.append((top.as_posix() + ("/" if (path / top).is_dir() else ""), "hidden"))
            continue
        if not p.is_file():
            continue
        if p.suffix.lower() in JSONL_SUFFIXES + TEXT_SUFFIXES:
            found.append(p)
        else:
            skipped.append((rel.as_posix(), f"not {'/'.join(JSONL_SUFFIXES + TEXT_SUFFIXES)}"))
    if not found:
        raise DataError(f"{path}: folder has no usable data files. Put .jsonl/.json (JSON Lines) or "
                        f"{'/'.join(TEXT_SUFFIXES)} files in it, or pass a single file."
                        + (f" Passed over: {_skipped_text(skipped)}." if skipped else ""))
    return found, skipped


def _skipped_text(skipped: list[tuple[str, str]]) -> str:
    """'a.bin (not .jsonl/...), .git/ (hidden)', the first SKIPPED_SHOWN named and the rest counted."""
    shown = ", ".join(f"{name} ({why})" for name, why in skipped[:SKIPPED_SHOWN])
    more = len(skipped) - SKIPPED_SHOWN
    return shown + (f" and {more:,} more" if more > 0 else "")


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")   # tolerate a UTF-8 byte-order mark
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start}). "
                        f"Re-save the file as UTF-8, or remove it if it is not text.") from None
    if not text.strip():
        raise DataError(f"{path}: the file is empty. Add data to it or remove it.")
    return text


def _text_pieces(path: Path, text: str) -> Iterator[_Piece]:
    start = 0
    while start < len(text):
        cut = text.find("\n", start + _TEXT_PIECE_CHARS)  # whole lines per piece: no word split
        end = len(text) if cut < 0 else cut + 1
        yield _Piece(text[start:end], None, start == 0, end == len(text), True, str(path))
        start = end


def _string(rec: dict, key: str, where: str, allow_empty: bool = True) -> str:
    v = rec[key]
    if not isinstance(v, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(v).__name__}. "
                        f"Accepted records: {ACCEPTED_RECORDS}.")
    if not allow_empty and not v:
        raise DataError(f"{where}: field {key!r} is empty; there would be nothing to train on. "
                        f"Fill it in or delete the line.")
    return v


def _record_piece(rec: Any, where: str, tokenizer) -> _Piece:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}. "
                        f"Each line must be one record: {ACCEPTED_RECORDS}.")
    keys = set(rec)
    expected = ({"messages"} if "messages" in keys else {"text"} if "text" in keys
                else {"prompt", "completion"} if keys & {"prompt", "completion"} else None)
    if expected is None or keys != expected:
        problems = []
        if expected is None:
            problems.append(f"no recognised field (found {sorted(keys)})")
        else:
            if expected - keys:
                problems.append(f"missing field(s) {sorted(expected - keys)}")
            if keys - expected:
                problems.append(f"unknown field(s) {sorted(keys - expected)} next to {sorted(expected)}")
        hint = " (this looks like ShareGPT; convert from/value to role/content)" if "conversations" in keys else ""
        raise DataError(f"{where}: {'; '.join(problems)}{hint}. Accepted records, with no other fields: "
                        f"{ACCEPTED_RECORDS}.")
    if expected == {"text"}:
        return _Piece(_string(rec, "text", where, allow_empty=False), None, True, True, True, where)
    if expected == {"prompt", "completion"}:
        prompt = _string(rec, "prompt", where)
        completion = _string(rec, "completion", where, allow_empty=False)
        text = prompt + completion
        return _Piece(text, [(len(prompt), len(text))], True, True, True, where)
    return _chat_piece(rec["messages"], where, tokenizer)


def _chat_piece(messages: Any, where: str, tokenizer) -> _Piece:
    example = '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list like {example}.")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{n}] must be an object with string 'role' and 'content', "
                            f"got {json.dumps(m)[:80]}. Expected a list like {example}.")
    turns = [n for n, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DataError(f"{where}: the conversation has no 'assistant' message, so nothing in it would be "
                        f"trained. Add the assistant reply or delete the line.")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: this record has 'messages', but the tokenizer has no chat template to "
                        f"render them with. Use {{\"text\": ...}} or {{\"prompt\": ..., \"completion\": ...}} "
                        f"records instead, or a model whose tokenizer has a chat template (a chat/instruct model).")

    def render(msgs: list, gen: bool) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # jinja raises all sorts; the template's own message is what helps
            raise DataError(f"{where}: the tokenizer's chat template rejected this conversation: {e}. "
                            f"Fix the conversation (e.g. role order) or use prompt/completion records.") from None

    def shared(prefix: str, full: str) -> int:
        # Templates that rewrite earlier turns once later ones exist (e.g. dropping old reasoning) break
        # the prefix property; then only the part both renderings agree on can be attributed to the turn.
        return len(prefix) if full.startswith(prefix) else len(os.path.commonprefix([prefix, full]))

    # Each assistant turn spans from the end of "everything before it + generation prompt" to the end of
    # "everything up to and including it" (trailing whitespace after the end marker excluded). Working
    # on characters and mapping to tokens afterwards avoids token-boundary merges between renderings.
    full = render(messages, False)
    spans = []
    for n in turns:
        try:
            start = shared(render(messages[:n], True), full)
        except DataError:
            if n:
                raise
            start = 0   # some templates cannot render an empty conversation; a leading reply trains its header
        end = shared(render(messages[: n + 1], False).rstrip(), full)
        if end > start:
            spans.append((start, end))
    return _Piece(full, spans, True, True, False, where)


def _jsonl_pieces(path: Path, text: str, tokenizer) -> Iterator[_Piece]:
    any_record = False
    # Only \n ends a record: str.splitlines() would also split at U+2028 etc., legal raw inside JSON strings.
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            hint = (" The file looks like pretty-printed JSON or a JSON array; JSON Lines needs one complete "
                    "object per line." if line.strip() in ("[", "{") or line.lstrip().startswith("[{") else "")
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno}).{hint} Each line must be "
                            f"one record: {ACCEPTED_RECORDS}.") from None
        any_record = True
        yield _record_piece(rec, where, tokenizer)
    if not any_record:
        raise DataError(f"{path}: the file is empty (no records). Add JSON Lines records ({ACCEPTED_RECORDS}) "
                        f"or remove it.")


# ---------------------------------------------------------------------------------------------- encoding

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
