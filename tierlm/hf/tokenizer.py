"""Tokenizers for models tierlm creates from scratch: byte-level BPE, saved as a HF tokenizer.

Nothing is downloaded: either a BPE is trained on the user's text, or a plain byte tokenizer (256
byte tokens, no merges) is written, which encodes any text. Both use the GPT-2 byte-level alphabet
so any text encodes, and both carry ChatML special tokens and a chat template.

The pipeline is Qwen2's (NFC, Qwen2 split regex, byte-level) on purpose: transformers 5.x ignores
tokenizer.json's pipeline for `model_type: qwen2` and rebuilds Qwen2Tokenizer's own from the
vocab and merges, so any other pipeline would encode differently once loaded back for a qwen2
model. With Qwen2's, every architecture loads exactly the tokenizer written here.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS = [EOT, IM_START, IM_END]  # ids 0, 1, 2 in every tokenizer made here

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Same string as transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (a test checks).
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _byte_level(tk: Tokenizer) -> Tokenizer:
    # No prefix space, so decode(encode(s)) == s for any NFC-normalised s.
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    return tk


def _bytes_only() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tk = _byte_level(Tokenizer(models.BPE(vocab=vocab, merges=[])))
    tk.add_special_tokens(SPECIALS)
    return tk


def _trained(text_files: list[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    missing = [f for f in text_files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"tokenizer training text not found: {', '.join(missing)}")
    tk = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIALS,
        # every byte, seen in the text or not, so unseen text still encodes
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train([str(f) for f in text_files], trainer)
    return tk


def make_tokenizer(out_dir: str | os.PathLike, text_files: list[str] | None = None, vocab_size: int = 32000,
                   min_frequency: int = 2, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Build a byte-level tokenizer (BPE trained on `text_files`, else bytes only) and save it to out_dir.

    At most `vocab_size` tokens (specials included), so it fits a model with that vocab_size;
    `special_token_ids(tok)` gives the ids to put in the model's config.
    """
    n_min = len(SPECIALS) + 256
    if vocab_size < n_min:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer: it needs at least "
                         f"{n_min} tokens (256 bytes + {len(SPECIALS)} specials); raise the model's vocab")
    tk = _trained(list(text_files), vocab_size, min_frequency) if text_files else _bytes_only()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        # Base-model convention (GPT-2, Qwen): one end-of-text token that also pads; nothing is
        # prepended automatically, so bos is informational and chat turns are delimited by ChatML.
        bos_token=EOT, eos_token=EOT, pad_token=EOT, unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length or 1_000_000,
    )
    if len(tok) > vocab_size:
        raise AssertionError(f"tokenizer has {len(tok)} tokens, more than vocab_size={vocab_size}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return tok


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """The prompt ids of a conversation with the generation prompt, by the tokenizer's chat template
    (transformers reads it from chat_template.jinja, where transformers 5 saves it, or from
    tokenizer_config.json's "chat_template", where older uploads have it; named templates are a dict
    and "default" is used). ValueError where there is none; the template's own errors pass through."""
    if not getattr(tok, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template (neither chat_template.jinja nor "
                         "tokenizer_config.json's 'chat_template')")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here, 4.x a list of ids
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def special_token_ids(tok) -> dict[str, int]:
    """bos/eos/pad ids plus the ChatML end-of-turn id, as config / generation_config want them."""
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "im_end_token_id": tok.convert_tokens_to_ids(IM_END)}


def eos_ids_of(tokenizer, model_dir) -> list[int]:
    """End-of-sequence ids: the tokenizer's, and the model's as transformers' generate takes them:
    generation_config.json's (a list in chat models: end of text and end of turn), or, where the
    directory has no generation_config.json (older uploads), config.json's. A generation config
    without one adds none."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    d = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        f = d / name
        if f.is_file():
            e = json.loads(f.read_text()).get("eos_token_id")
            ids.update(int(i) for i in (e if isinstance(e, list) else [e]) if i is not None)
            break  # transformers takes config.json's only when there is no generation_config.json
    return sorted(ids)
