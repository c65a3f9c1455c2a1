"""Data pipeline tests with a tiny byte-level BPE tokenizer built offline."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tierlm.train.data import Batches, DataError, PackedDataset, load_dataset

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog.",
          "Question: what is two plus two? Answer: four.",
          "you are a helpful assistant. the user asks and the assistant answers."]


def _make(chat_template=CHATML, bos="<s>"):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="</s>", pad_token="<pad>",
                                   chat_template=chat_template)


@pytest.fixture(scope="module")
def tk():
    return _make()


def enc(tk, text):
    return tk(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def only_row(ds):
    assert len(ds) == 1
    return ds[0]


def real(ids, labels, tk):
    """Strip end padding (pad tokens are never trained)."""
    n = len(ids)
    while n and ids[n - 1] == tk.pad_token_id and labels[n - 1] == -100:
        n -= 1
    return ids[:n].tolist(), labels[:n].tolist()


# ------------------------------------------------------------------------------------------ record kinds

def test_text_record(tmp_path, tk):
    ds = load_dataset(write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}]), tk, 64)
    ids, labels = only_row(ds)
    assert ids.dtype == labels.dtype == torch.long and ids.shape == labels.shape == (64,)
    want = [tk.bos_token_id] + enc(tk, "hello world") + [tk.eos_token_id]
    got_ids, got_labels = real(ids, labels, tk)
    assert got_ids == want
    assert got_labels == [-100] + want[1:]          # BOS is never a target
    assert (labels[len(want):] == -100).all()      # padding masked
    assert ds.num_trainable_tokens == len(want) - 1
    assert ds.num_tokens == len(want)


def test_prompt_completion_masks_exact_positions(tmp_path, tk):
    prompt, completion = "Question: what is two plus two?\n", "Answer: four."
    p, c = enc(tk, prompt), enc(tk, completion)
    assert enc(tk, prompt + completion) == p + c   # precondition for exact positions
    ds = load_dataset(write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "completion": completion}]), tk, 64)
    ids, labels = real(*only_row(ds), tk)
    assert ids == [tk.bos_token_id] + p + c + [tk.eos_token_id]
    assert labels == [-100] * (1 + len(p)) + c + [tk.eos_token_id]


def test_messages_train_only_assistant_content_and_end_marker(tmp_path, tk):
    msgs = [{"role": "system", "content": "you are a helpful assistant."},
            {"role": "user", "content": "what is two plus two?"},
            {"role": "assistant", "content": "four."},
            {"role": "user", "content": "and the fox?"},
            {"role": "assistant", "content": "the quick brown fox."}]
    ds = load_dataset(write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}]), tk, 128)
    ids, labels = real(*only_row(ds), tk)
    full = tk.apply_chat_template(msgs, tokenize=False)
    assert ids == [tk.bos_token_id] + enc(tk, full) + [tk.eos_token_id]
    trained = [t for t in labels if t != -100]
    end = tk.convert_tokens_to_ids("<|im_end|>")
    assert trained == enc(tk, "four.") + [end] + enc(tk, "the quick brown fox.") + [end]
    # the trained tokens sit exactly where the assistant contents are
    pos = [i for i, t in enumerate(labels) if t != -100]
    assert tk.decode([ids[i] for i in pos]) == "four.<|im_end|>the quick brown fox.<|im_end|>"
    assert labels[-1] == -100   # separator EOS after a chat is not a target


def test_chat_template_with_bos_is_not_doubled(tmp_path):
    tk = _make(chat_template="{{ bos_token }}" + CHATML)
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    ids, _ = real(*only_row(load_dataset(write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}]), tk, 64)), tk)
    assert ids.count(tk.bos_token_id) == 1 and ids[0] == tk.bos_token_id


def test_unicode_line_separator_inside_record(tmp_path, tk):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "hello\u2028world"}\r\n{"text": "the\x85dog"}\n', encoding="utf-8")
    assert load_dataset(p, tk, 64).documents == 2


def test_no_bos_token(tmp_path):
    tk = _make(bos=None)
    ids, labels = real(*only_row(load_dataset(write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}]), tk, 32)), tk)
    assert ids == enc(tk, "hello") + [tk.eos_token_id]
    assert labels == ids   # labels[0] is shifted away by the model, but stays equal to input_ids


# ------------------------------------------------------------------------------------------ packing

def test_packing_rows_and_tail(tmp_path, tk):
    texts = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(20)]
    ds = load_dataset(write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts]), tk, 16)
    stream = []
    for t in texts:
        stream += [tk.bos_token_id] + enc(tk, t) + [tk.eos_token_id]
    assert len(ds) == len(stream) // 16
    assert ds.dropped_tail_tokens == len(stream) % 16
    rows = [ds[i][0] for i in range(len(ds))]
    assert all(r.shape == (16,) for r in rows)
    assert torch.cat(rows).tolist() == stream[: len(ds) * 16]
    assert ds.num_tokens == len(ds) * 16
    assert ds.num_trainable_tokens == sum(int((ds[i][1][1:] != -100).sum()) for i in range(len(ds)))
    assert "20 documents" in ds.summary() and f"{len(ds)} rows x 16" in str(ds)


def test_fully_masked_rows_dropped(tmp_path, tk):
    long_prompt = "the quick brown fox jumps over the lazy dog. " * 4
    recs = [{"prompt": long_prompt, "completion": "four."}] * 3
    ds = load_dataset(write_jsonl(tmp_path / "d.jsonl", recs), tk, 8)
    assert ds.dropped_masked_rows > 0
    for i in range(len(ds)):
        assert (ds[i][1][1:] != -100).any()


def test_all_rows_masked_is_an_error(tmp_path, tk):
    recs = [{"prompt": "the quick brown fox jumps over the lazy dog. " * 6, "completion": "x"}]
    with pytest.raises(DataError, match="nothing to train"):
        load_dataset(write_jsonl(tmp_path / "d.jsonl", recs), tk, 8)


def test_seq_len_validated(tmp_path, tk):
    with pytest.raises(DataError, match="seq-len"):
        load_dataset(write_jsonl(tmp_path / "d.jsonl", [{"text": "hi"}]), tk, 1)


def test_too_short_data():
    with pytest.raises(DataError, match="1 token"):
        PackedDataset(torch.tensor([5], dtype=torch.int32), torch.tensor([True]), 8, 0, source="x.txt")


# ------------------------------------------------------------------------------------------ files & folders

def test_plain_text_file(tmp_path, tk):
    p = tmp_path / "notes.md"
    p.write_text("hello world\nthe lazy dog\n", encoding="utf-8")
    ids, labels = real(*only_row(load_dataset(p, tk, 64)), tk)
    assert ids == [tk.bos_token_id] + enc(tk, "hello world\nthe lazy dog\n") + [tk.eos_token_id]
    assert labels == [-100] + ids[1:]


def test_long_text_file_is_one_document(tmp_path, tk, monkeypatch):
    import tierlm.train.data_formats as formats
    monkeypatch.setattr(formats, "_TEXT_PIECE_CHARS", 20)
    text = "".join(f"line {i} of the quick brown fox\n" for i in range(30))
    p = tmp_path / "long.txt"
    p.write_text(text)
    ds = load_dataset(p, tk, 4096)
    ids, _ = real(*only_row(ds), tk)
    assert ids.count(tk.bos_token_id) == 1 and ids.count(tk.eos_token_id) == 1
    assert tk.decode(ids[1:-1]) == text and ds.documents == 1


def test_folder_recursive_sorted(tmp_path, tk):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("the lazy dog")
    write_jsonl(tmp_path / "a.jsonl", [{"text": "hello"}])
    (tmp_path / "c.md").write_text("world")
    (tmp_path / "image.bin").write_bytes(b"\xff\xfe\x00")   # skipped: not a data extension
    (tmp_path / ".hidden.txt").write_bytes(b"\xff")          # skipped: hidden
    ds = load_dataset(tmp_path, tk, 256)
    ids, _ = real(*only_row(ds), tk)
    b, e = tk.bos_token_id, tk.eos_token_id
    assert ids == [b] + enc(tk, "hello") + [e, b] + enc(tk, "the lazy dog") + [e, b] + enc(tk, "world") + [e]
    assert ds.files == 3 and ds.documents == 3
    # what was passed over is named, and why: a folder's data line says what was not read
    assert ds.skipped == [(".hidden.txt", "hidden"), ("image.bin", "not .jsonl/.json/.txt/.md/.markdown/.rst/.text")]
    assert "not read: .hidden.txt (hidden), image.bin (not .jsonl" in ds.summary()


def test_a_hidden_folder_is_named_once_and_a_long_list_is_cut(tmp_path, tk):
    (tmp_path / "d.txt").write_text("hello")
    (tmp_path / ".git").mkdir()
    for name in ("HEAD", "config", "index"):
        (tmp_path / ".git" / name).write_text("x")
    for i in range(6):
        (tmp_path / f"scan{i}.png").write_bytes(b"\x89")
    ds = load_dataset(tmp_path, tk, 256)
    assert ds.skipped[0] == (".git/", "hidden") and len(ds.skipped) == 7
    assert ds.summary().endswith("scan3.png (not .jsonl/.json/.txt/.md/.markdown/.rst/.text) and 2 more")


def test_counts_of_one_are_singular(tmp_path, tk):
    (tmp_path / "one.txt").write_text("hello world")
    line = load_dataset(tmp_path / "one.txt", tk, 2).summary()
    assert line.startswith("1 document from 1 file -> ")
    assert "documents" not in line and "files" not in line


# ------------------------------------------------------------------------------------------ errors

def _err(path, tk, seq_len=64):
    with pytest.raises(DataError) as e:
        load_dataset(path, tk, seq_len)
    return str(e.value)


@pytest.mark.parametrize("bad, needle", [
    ('{"text": "ok"', "invalid JSON"),
    ('["text"]', "expected a JSON object"),
    ('{"prompt": "q"}', "missing field(s) ['completion']"),
    ('{"text": "a", "id": 3}', "unknown field(s) ['id']"),
    ('{"foo": "a"}', "no recognised field"),
    ('{"text": 5}', "'text' must be a string"),
    ('{"prompt": "q", "completion": ["a"]}', "'completion' must be a string"),
    ('{"text": ""}', "'text' is empty"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "user", "content": 3}]}', "messages[0]"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no 'assistant' message"),
])
def test_record_errors_name_file_and_line(tmp_path, tk, bad, needle):
    p = write_jsonl(tmp_path / "data.jsonl", [{"text": "fine"}, "", bad])
    msg = _err(p, tk)
    assert "data.jsonl:3:" in msg and needle in msg
    if "field" in needle or "object" in needle:
        assert '{"prompt"' in msg and '{"messages"' in msg   # says what is accepted


def test_pretty_printed_json_hint(tmp_path, tk):
    p = tmp_path / "d.json"
    p.write_text('[\n  {"text": "a"}\n]\n')
    msg = _err(p, tk)
    assert "d.json:1:" in msg and "one complete object per line" in msg


def test_messages_without_chat_template(tmp_path):
    tk = _make(chat_template=None)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    msg = _err(write_jsonl(tmp_path / "chat.jsonl", [{"text": "a"}, {"messages": msgs}]), tk)
    assert "chat.jsonl:2:" in msg and "no chat template" in msg and '"prompt"' in msg


def test_chat_template_failure_names_line(tmp_path):
    tk = _make(chat_template="{{ raise_exception('roles must alternate') }}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    msg = _err(write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}]), tk)
    assert "chat.jsonl:1:" in msg and "roles must alternate" in msg


def test_empty_files(tmp_path, tk):
    (tmp_path / "e.jsonl").write_text("\n  \n")
    assert "e.jsonl" in (m := _err(tmp_path / "e.jsonl", tk)) and "empty" in m
    (tmp_path / "e.txt").write_text("")
    assert "e.txt" in (m := _err(tmp_path / "e.txt", tk)) and "empty" in m


def test_folder_without_data(tmp_path, tk):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"\x00")
    msg = _err(tmp_path / "d", tk)
    assert str(tmp_path / "d") in msg and "no usable data files" in msg and ".jsonl" in msg


def test_missing_path(tmp_path, tk):
    msg = _err(tmp_path / "nope.jsonl", tk)
    assert "nope.jsonl" in msg and "no such file" in msg


def test_not_utf8_names_line(tmp_path, tk):
    p = tmp_path / "latin.txt"
    p.write_bytes("line one\nline two\ncaf\xe9\n".encode("latin-1"))
    msg = _err(p, tk)
    assert "latin.txt:3:" in msg and "UTF-8" in msg


def test_error_is_value_error():
    assert issubclass(DataError, ValueError)


# ------------------------------------------------------------------------------------------ batches

@pytest.fixture(scope="module")
def ds(tk, tmp_path_factory):
    p = tmp_path_factory.mktemp("b") / "d.jsonl"
    write_jsonl(p, [{"text": f"the quick brown fox {i} jumps"} for i in range(60)])
    d = load_dataset(p, tk, 8)
    assert len(d) >= 20
    return d


def _take(b, n):
    return [next(b) for _ in range(n)]


def test_batches_shapes_and_epoch_coverage(ds):
    b = Batches(ds, 4, seed=1)
    per = b.batches_per_epoch
    batches = _take(b, per)
    assert all(x.shape == y.shape and x.shape[1] == 8 for x, y in batches)
    assert sum(x.shape[0] for x, _ in batches) == len(ds)
    seen = sorted(tuple(r.tolist()) for x, _ in batches for r in x)
    assert seen == sorted(tuple(ds[i][0].tolist()) for i in range(len(ds)))
    assert b.state_dict()["epoch"] == 1 and b.state_dict()["index"] == 0


def test_batches_deterministic_and_epochs_reshuffle(ds):
    a, b = Batches(ds, 3, seed=7), Batches(ds, 3, seed=7)
    for (x1, y1), (x2, y2) in zip(_take(a, 30), _take(b, 30)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    s = Batches(ds, 3, seed=7)
    assert not torch.equal(s.order(0), s.order(1))
    assert sorted(s.order(1).tolist()) == list(range(len(ds)))
    assert not torch.equal(Batches(ds, 3, seed=8).order(0), s.order(0))
    assert torch.equal(Batches(ds, 3, seed=0, shuffle=False).order(5), torch.arange(len(ds)))


def test_peek_shows_the_next_batch_and_takes_nothing(ds):
    """Across epoch ends too: finetune peeks the next step's ids (Engine.expect) before the
    position is saved, so the saved position must not move."""
    a, b = Batches(ds, 3, seed=5), Batches(ds, 3, seed=5)
    for _ in range(3 * b.batches_per_epoch):
        state = a.state_dict()
        px, py = a.peek()
        assert a.state_dict() == state
        x, y = next(a)
        bx, by = next(b)
        assert torch.equal(px, x) and torch.equal(py, y) and torch.equal(x, bx) and torch.equal(y, by)


def test_resume_continues_identically(ds):
    ref = Batches(ds, 3, seed=3)
    expected = _take(ref, 25)
    first = Batches(ds, 3, seed=3)
    _take(first, 11)                     # crosses no/one epoch boundary depending on len(ds)
    state = json.loads(json.dumps(first.state_dict()))   # survives a JSON checkpoint
    resumed = Batches(ds, 3, seed=3)
    resumed.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(expected[11:], _take(resumed, 14)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_resume_with_other_batch_size_continues_at_same_sample(ds):
    ref = Batches(ds, 1, seed=5, shuffle=True)
    rows = [x[0] for x, _ in _take(ref, 12)]
    b = Batches(ds, 4, seed=5)
    _take(b, 2)
    c = Batches(ds, 2, seed=5)
    c.load_state_dict(b.state_dict())
    got = [r for x, _ in _take(c, 2) for r in x]
    assert all(torch.equal(g, w) for g, w in zip(got, rows[8:12]))


def test_drop_last(ds):
    b = Batches(ds, 7, seed=0, drop_last=True)
    assert all(x.shape[0] == 7 for x, _ in _take(b, 3 * b.batches_per_epoch))
    with pytest.raises(DataError, match="larger than the dataset"):
        Batches(ds, len(ds) + 1, seed=0, drop_last=True)


def test_resume_mismatch_rejected(ds):
    state = Batches(ds, 2, seed=1).state_dict()
    with pytest.raises(DataError, match="seed"):
        Batches(ds, 2, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="num_rows"):
        Batches(ds, 2, seed=1).load_state_dict({**state, "num_rows": len(ds) + 1})


def test_tokenizer_without_offsets_gives_same_masks(tmp_path, tk, monkeypatch):
    import tierlm.train.data as data

    class NoOffsets(data._Encoder):
        def __init__(self, tokenizer):
            super().__init__(tokenizer)
            self.fast = False

    msgs = [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four."}]
    recs = [{"text": "hello world"}, {"prompt": "Question: hi\n", "completion": "Answer: four."}, {"messages": msgs}]
    p = write_jsonl(tmp_path / "d.jsonl", recs)
    want = only_row(load_dataset(p, tk, 128))
    monkeypatch.setattr(data, "_Encoder", NoOffsets)
    got = only_row(load_dataset(p, tk, 128))
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
