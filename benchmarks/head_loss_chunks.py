"""The head and causal-LM loss of Qwen2.5-0.5B's shape: HF's whole logits against tierlm's chunks.

    flock /tmp/tierlm-bench.lock python benchmarks/head_loss_chunks.py

Forward + backward of a 151936 x 896 head over 2 x 448 tokens in fp32, for HF's path (the logits
whole, F.cross_entropy) and for tierlm.engine.head_loss at several chunk sizes, side by side in one
process; the second of two runs each. This is what chose head_loss.MIN_CHUNK_TOKENS.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from tierlm.engine.head_loss import causal_lm_loss


def main() -> None:
    torch.manual_seed(0)
    vocab, hidden, tokens = 151936, 896, 896
    head = nn.Linear(hidden, vocab, bias=False)
    labels = torch.randint(0, vocab, (2, tokens // 2))

    def run(chunk):
        h = torch.randn(2, tokens // 2, hidden, requires_grad=True)
        head.weight.grad = None
        t0 = time.perf_counter()
        if chunk is None:
            logits = head(h).float()
            shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
            loss = F.cross_entropy(logits.reshape(-1, vocab), shifted.reshape(-1), ignore_index=-100)
        else:
            loss = causal_lm_loss(h, head, labels, chunk)
        t1 = time.perf_counter()
        loss.backward()
        return t1 - t0, time.perf_counter() - t1

    for chunk in (None, 27, 128, 256, 448):
        fwd, bwd = [run(chunk) for _ in range(2)][-1]
        name = "HF, whole logits" if chunk is None else f"chunks of {chunk} tokens"
        print(f"{name}: forward {fwd:.2f} s, backward {bwd:.2f} s, total {fwd + bwd:.2f} s", flush=True)


if __name__ == "__main__":
    main()
