"""Reading fine-tuning data files: which files a path names, and each file's documents as pieces
of text to encode, with the character spans trained. Records are validated here, so a bad line
names its file and line before anything is tokenised (the accepted formats: train/data.py)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
ACCEPTED_RECORDS = ('{"text": "..."}, {"prompt": "...", "completion": "..."} or '
                    '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}')
_TEXT_PIECE_CHARS = 1 << 18   # long text files are encoded in newline-aligned pieces: bounded memory per call
SKIPPED_SHOWN = 5  # skipped files named in the data line; the rest are counted


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
