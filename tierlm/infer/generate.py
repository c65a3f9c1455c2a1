"""Generation with the engine's streamed weights and a KV cache (greedy or sampled)."""
from __future__ import annotations

import torch


@torch.no_grad()
def generate_ids(engine, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, eos_token_id: int | list[int] | None = None, seed: int = 0) -> torch.Tensor:
    """Prefill the prompt, then decode one token at a time; each forward streams the layers once.
    Stops when every row has produced one of `eos_token_id` (one id or several: chat models end a
    turn with their own token besides end-of-text); the eos token is kept in the output."""
    from transformers import DynamicCache

    from .kvcache import cache_kwarg

    gen = torch.Generator().manual_seed(seed)
    eos = torch.tensor([] if eos_token_id is None else
                       [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    cache = DynamicCache()
    pass_cache = {cache_kwarg(engine.model): cache}
    ids = input_ids
    out_tokens = []
    was = engine.training
    engine.training = False
    try:
        step_in = ids
        for _ in range(max_new_tokens):
            logits = engine.forward(step_in, use_cache=True, **pass_cache).logits[:, -1, :].float().cpu()
            if temperature <= 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, -1)
                if top_p < 1.0:
                    sp, si = probs.sort(-1, descending=True)
                    keep = sp.cumsum(-1) - sp < top_p
                    probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
                nxt = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=gen)[:, 0]
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
    from .batcher import eos_ids_of

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    model_dir = getattr(engine, "model_dir", None)  # an engine from_model has none: the tokenizer's eos
    eos = eos_ids_of(tokenizer, model_dir) if model_dir else tokenizer.eos_token_id
    out = generate_ids(engine, ids, max_new_tokens, temperature, eos_token_id=eos, seed=seed)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
