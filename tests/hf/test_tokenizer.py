import unicodedata

import pytest
from transformers import AutoTokenizer

from tierlm.hf.presets import make_config
from tierlm.hf.tokenizer import IM_END, IM_START, PRETOKENIZE_REGEX, make_tokenizer, special_token_ids

SAMPLES = [
    "Hello, world!",
    "héllo wörld — ünïcödé 🤖🚀 中文 العربية",
    "e\u0301 (decomposed) and 12345 digits",
    "tabs\tand\nnewlines\r\n  double  spaces ",
    "\x00\x01 control bytes \x7f",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


def test_pipeline_regex_is_qwen2s():
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as qwen2_regex

    assert PRETOKENIZE_REGEX == qwen2_regex


def test_byte_tokenizer_encodes_any_text(tmp_path):
    tok = make_tokenizer(tmp_path, None, vocab_size=512)
    assert len(tok) == 259
    for s in SAMPLES:
        ids = tok(s)["input_ids"]
        assert max(ids, default=0) < 259
        assert tok.decode(ids) == unicodedata.normalize("NFC", s)
    assert tok.convert_tokens_to_ids([IM_START, IM_END]) == [1, 2]
    # specials are single tokens, plain text never produces them
    assert tok("<|im_end|>")["input_ids"] == [2]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_auto_tokenizer_loads_identically_for_every_arch(tmp_path, arch):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog 0123456789\n" * 50 + "tokenizers are fun\n" * 30)
    tok = make_tokenizer(tmp_path / "tok", [str(text)], vocab_size=320, min_frequency=2)
    assert 259 < len(tok) <= 320  # merges were learned, vocab bound respected
    make_config(arch, overrides={"vocab": 320}).save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(loaded) == len(tok)
    for s in SAMPLES + ["the quick brown fox"]:
        assert loaded(s)["input_ids"] == tok(s)["input_ids"], (arch, s)
    assert len(tok("the quick brown fox")["input_ids"]) < len("the quick brown fox")
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 0, 0)


def test_chat_template(tmp_path):
    make_tokenizer(tmp_path, None, vocab_size=300)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == tok(text)["input_ids"] and ids[0] == 1 and ids.count(2) == 2


def test_vocab_limits_and_ids(tmp_path):
    with pytest.raises(ValueError, match="at least 259"):
        make_tokenizer(tmp_path, None, vocab_size=258)
    tok = make_tokenizer(tmp_path, None, vocab_size=259)
    assert special_token_ids(tok) == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
                                      "im_end_token_id": 2}
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        make_tokenizer(tmp_path, [str(tmp_path / "missing.txt")], vocab_size=400)


def test_a_sentencepiece_only_directory_loads(tmp_path):
    """A Llama-style checkpoint with tokenizer.model and tokenizer_config.json but no tokenizer.json
    (as older checkpoints ship) loads through transformers' SentencePiece conversion, which needs the
    sentencepiece and protobuf packages tierlm depends on, and encodes as SentencePiece itself does."""
    import inspect
    import json as json_mod
    import os

    import sentencepiece as spm

    from tierlm.hf.checks import load_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(inspect.getsource(os) + inspect.getsource(json_mod), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=600,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.99,
                                   minloglevel=2)
    d = tmp_path / "model"
    d.mkdir()
    (d / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    (d / "tokenizer_config.json").write_text(json_mod.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "legacy": False}))
    assert not (d / "tokenizer.json").exists()

    tok = load_tokenizer(d)
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    for text in ("Return the value of os.path", "def loads(s, *, cls=None):", "héllo wörld 🤖"):
        ids = tok(text)["input_ids"]
        assert ids[0] == sp.bos_id() and ids[1:] == sp.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == text
