"""The one sampler: sampling parameters, the choice of the next token (greedy or seeded, one row or
a batch of rows), generation over a model's HF-style forward, and text streaming that respects stop
strings. The batcher (`tierlm generate`, `chat`, `serve`) and `generate_ids` (the fine-tuning
engine's sample) choose through `choose_rows`, so a seed gives the same tokens on either path."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..hf.meta_forward import cache_kwarg
from ..hf.tokenizer import eos_ids_of


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0       # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                 # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False       # benchmarks: always run max_tokens

    def check(self) -> None:
        """Raise ValueError naming the bad field (the server turns it into a 400)."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k!r}")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of at most 16 non-empty strings")


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def choose_rows(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """The next token of each row of fp32 logits [..., vocab]: greedy at temperature 0, else top-k,
    then top-p (the smallest prefix of the sorted distribution whose mass reaches top_p), then one
    draw from `gen`. Rows are drawn together, in one call, as generation always drew them."""
    if p.temperature <= 0:
        return logits.argmax(-1)
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < p.top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=gen)[..., 0]


def choose(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """The next token from one row's fp32 logits [vocab]."""
    return int(choose_rows(logits, p, gen))


@torch.no_grad()
def generate_ids(engine, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, eos_token_id: int | list[int] | None = None, seed: int = 0) -> torch.Tensor:
    """Prefill the prompt, then decode one token at a time over `engine.forward` (an HF-style model
    or the fine-tuning engine, whose every forward streams the layers once) with a DynamicCache.
    Stops when every row has produced one of `eos_token_id` (one id or several: chat models end a
    turn with their own token besides end-of-text); the eos token is kept in the output."""
    from transformers import DynamicCache

    params = SamplingParams(temperature=temperature, top_p=top_p)
    gen = make_generator(seed)
    eos = torch.tensor([] if eos_token_id is None else
                       [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    pass_cache = {cache_kwarg(engine.model): DynamicCache()}
    out_tokens = []
    was = engine.training
    engine.training = False
    try:
        step_in = input_ids
        for _ in range(max_new_tokens):
            logits = engine.forward(step_in, use_cache=True, **pass_cache).logits[:, -1, :].float().cpu()
            nxt = choose_rows(logits, params, gen)
            out_tokens.append(nxt)
            done |= torch.isin(nxt, eos)
            if bool(done.all()):
                break
            step_in = nxt[:, None]
    finally:
        engine.training = was
    return torch.cat([input_ids, torch.stack(out_tokens, 1)], 1) if out_tokens else input_ids


def generate(engine, tokenizer, prompt: str, max_new_tokens: int = 40, temperature: float = 0.0,
             seed: int = 0) -> str:
    """The completion of `prompt` as text (the fine-tuning run's sample)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    model_dir = getattr(engine, "model_dir", None)  # an engine from_model has none: the tokenizer's eos
    eos = eos_ids_of(tokenizer, model_dir) if model_dir else tokenizer.eos_token_id
    out = generate_ids(engine, ids, max_new_tokens, temperature, eos_token_id=eos, seed=seed)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


class TextStream:
    """Turns the growing list of generated ids into text deltas.

    Text is held back while it could still become a stop string or ends in an incomplete UTF-8
    sequence; a stop string ends the text before it (OpenAI's behaviour)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, stop
        self.sent = 0
        self.text = ""
        self.stopped = False

    def update(self, ids: list[int], final: bool = False) -> str:
        text = self.tok.decode(ids, skip_special_tokens=True)
        cut = len(text)
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and i < cut:
                cut, self.stopped = i, True
        if self.stopped:
            text = text[:cut]
        elif not final:
            hold = 0
            for s in self.stop:
                for n in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:n]):
                        hold = max(hold, n)
                        break
            if text.endswith("\ufffd"):
                hold = max(hold, 1)
            cut = len(text) - hold
        delta = text[self.sent:cut] if cut > self.sent else ""
        self.sent = max(self.sent, cut)
        self.text = text[:self.sent]
        return delta
