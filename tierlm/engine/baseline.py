"""Kernels a training step of this shape will load, loaded before the library baseline is measured
(`tierlm.hf.baseline.library_baseline`'s `warm`)."""
from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from ..hf.structure import causal_lm
from ..plan.budget import chunk_tokens
from .head_loss import causal_lm_loss


def warm_kernels(config, dtype: torch.dtype, device, batch: tuple[int, int]) -> None:
    """One forward and backward of a one-layer model of `config` on `device` (made there: nothing of
    it in host memory) at `batch`, the loss through the engine's head (head_loss), so that the
    kernels a step of this shape selects are loaded."""
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    device = torch.device(device)
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    with torch.device(device):
        m = causal_lm(AutoModelForCausalLM.from_config(one)).to(dtype)
    n, seq = batch
    ids = torch.randint(0, one.vocab_size, (n, seq), device=device)
    chunk = chunk_tokens(n * seq, one.vocab_size, dtype)
    if chunk is None:
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    else:
        hidden = m.base_model(input_ids=ids, use_cache=False).last_hidden_state
        loss = causal_lm_loss(hidden, m.get_output_embeddings(), ids, chunk)
    loss.backward()
    del m, loss
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, device)
