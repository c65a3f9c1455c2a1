"""Sampling parameters, the choice of the next token, and text streaming that respects stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


def choose(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """The next token from one row's fp32 logits [vocab]."""
    if p.temperature <= 0:
        return int(logits.argmax())
    x = logits / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, -1)
    if p.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < p.top_p   # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter(0, si, sp * keep)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


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
