"""The quality cost of a weight format: perplexity of the same text under each."""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def perplexity(engine, ids: list[int], window: int = 256, max_windows: int | None = None,
               decode: bool = False) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of `window` tokens of `ids`
    (each window scored from its own start, so every format sees exactly the same contexts).
    decode: each window fed one token a step through the KV cache, so every product runs the
    one-row loops that generating a token runs (x rounded as they round it), not a prefill's."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens of text")
    window = min(window, engine.max_len)
    nll, n = 0.0, 0
    starts = range(0, len(ids) - 1, window)
    for k, a in enumerate(starts):
        if max_windows is not None and k >= max_windows:
            break
        chunk = torch.tensor([ids[a: a + window + 1]])
        if chunk.shape[1] < 2:
            break
        if decode:
            logits = torch.cat([engine.step([[t]], [i]) for i, t in enumerate(chunk[0, :-1].tolist())])[None]
        else:
            logits = engine.logits_all(chunk[:, :-1])
        nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        n += chunk.shape[1] - 1
    return math.exp(nll / n)
