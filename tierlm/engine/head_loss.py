"""The head and the causal-LM loss a chunk of tokens at a time, so the logits never exist whole.

A 152K-entry vocabulary makes the logits the largest tensor of a step: at 896 tokens, HF's path holds
them in the compute dtype, their fp32 upcast, the log-softmax and its gradient, 2.2 GB for Qwen2.5-0.5B,
more than three of its decoder layers' activations. Here each chunk's logits are made, turned into
its share of the loss and straight away into its gradients (for the hidden states and for the head's
weight), and dropped; backward then only scales what forward computed. The FLOPs are those of the
unchunked path (no recomputation); what is held instead of the logits is the head weight's gradient,
from the end of forward rather than from the start of backward.

The loss is HF's ForCausalLMLoss (labels shifted left by one, -100 ignored, mean over the counted
tokens, fp32 softmax). Sums run in another order than one big product, so the result is equal to
HF's within rounding, not bit for bit: the engine chunks only when the logits are large (`tierlm.plan.budget.chunk_tokens`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100


def _add_low_product(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor, scratch: torch.Tensor) -> None:
    """grad_w (fp32) += g^T h for a bf16/fp16 chunk, on the CPU's low-precision products (fp32 sums
    inside each product, rounded once to the compute dtype a chunk and slice of rows, as autograd
    rounds a micro-batch's gradient), added in fp32. The fp32 product of upcast operands ran at a
    quarter of the speed (271M llama, 4x512 tokens in bf16, Zen 5: 0.70 s a step against 0.17).
    `scratch`: fp32 memory free meanwhile (the chunk's logits buffer, once g is rounded) that holds a
    slice's product and its fp32 copy (adding the low-precision product to fp32 directly converts
    on a slow path: 2.6 against 0.9 ms for 4096 x 1024), so no weight-sized temporary exists."""
    hdim = h.shape[1]
    flat = scratch.reshape(-1)
    if flat.numel() * 2 < 3 * hdim:  # a one-token chunk of a vocabulary narrower than the hidden size
        flat = torch.empty((3 * hdim + 1) // 2, dtype=torch.float32, device=h.device)
    rows = min(grad_w.shape[0], max(1, flat.numel() * 2 // (3 * hdim)))
    wide = flat[:rows * hdim].view(rows, hdim)
    narrow = flat[rows * hdim:].view(g.dtype)[:rows * hdim].view(rows, hdim)
    for v0 in range(0, grad_w.shape[0], rows):
        v1 = min(v0 + rows, grad_w.shape[0])
        out = torch.mm(g[:, v0:v1].t(), h, out=narrow[:v1 - v0])
        grad_w[v0:v1] += wide[:v1 - v0].copy_(out)


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, head, chunk):
        n = hidden.shape[0]
        valid = labels != IGNORE
        count = valid.sum()
        denom = count.clamp(min=1).to(torch.float32)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if weight.dtype != torch.float32 \
            else torch.zeros_like(weight)
        grad_b = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # One fp32 and one compute-dtype buffer for every chunk's logits and gradient: fresh tensors
        # each chunk were fresh pages the kernel zeroes (Qwen2.5-0.5B, 4x448 tokens in bf16: 14
        # chunks of 195 MB a step). copy_ converts as .to() does: the bits are unchanged.
        rows_max, vocab = min(chunk, n), weight.shape[0]
        f32 = torch.empty((rows_max, vocab), dtype=torch.float32, device=hidden.device)
        low = None if hidden.dtype == torch.float32 else \
            torch.empty((rows_max, vocab), dtype=hidden.dtype, device=hidden.device)
        for s in range(0, n, chunk):
            h = hidden[s:s + chunk]
            lab = labels[s:s + chunk]
            ok = valid[s:s + chunk]
            r = h.shape[0]
            logits = f32[:r].copy_(head(h))                # the module: its hooks load the weight
            lse = torch.logsumexp(logits, -1)
            tgt = logits.gather(1, lab.clamp(min=0)[:, None])[:, 0]
            total += ((lse - tgt) * ok).sum()
            g = logits.sub_(lse[:, None]).exp_()           # softmax, in the logits' memory
            rows = torch.arange(r, device=h.device)
            g[rows, lab.clamp(min=0)] -= 1.0
            g.mul_((ok.to(torch.float32) / denom)[:, None])
            if low is not None:
                g = low[:r].copy_(g)
            grad_h[s:s + chunk] = g @ weight
            # the head's gradient is summed in fp32: a 16-bit chunk's on 16-bit products, others in fp32
            if g.element_size() == 2 and grad_w.dtype == torch.float32:
                _add_low_product(grad_w, g, h, f32)  # the logits' fp32 buffer: g is in `low` now
            else:
                g_sum = g if g.dtype == grad_w.dtype else f32[:r].copy_(g)
                grad_w.addmm_(g_sum.t(), h.to(grad_w.dtype))
            if grad_b is not None:
                grad_b += g.sum(0).to(grad_b.dtype)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype))
        ctx.has_bias = bias is not None
        ctx.early = getattr(head, "tierlm_head_grad", None)
        return total / denom

    @staticmethod
    def backward(ctx, grad_out):
        # Scaled in place (the engine backpropagates a graph once): the head weight's gradient, 545 MB
        # for Qwen2.5-0.5B in fp32, exists once.
        grad_h, grad_w, grad_b = ctx.saved_tensors
        grad_w.mul_(grad_out.to(grad_w.dtype))
        if ctx.early is not None and ctx.early(grad_w):
            # the head weight's whole gradient from the head, now (a tied weight's rows the batch
            # does not look up get nothing more from the embedding): taken over by the engine
            # (engine/tied.py), which adds it to the embedding's later, so autograd never holds
            # both at once
            grad_w = None
        return grad_h.mul_(grad_out.to(grad_h.dtype)), grad_w, \
            (grad_b.mul_(grad_out.to(grad_b.dtype)) if ctx.has_bias else None), None, None, None


def causal_lm_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """HF's causal-LM loss of `head(hidden)` against `labels` [B, T], `chunk` tokens at a time."""
    hdim = hidden.shape[-1]
    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)
    return _HeadLoss.apply(hidden.reshape(-1, hdim), head.weight, head.bias, shifted, head, chunk)


def adds_router_loss(model) -> bool | None:
    """Whether the model's forward adds a mixture of experts' load-balancing loss to its loss (it
    records its routers' logits: output_router_logits); None where it does and the chunked path
    cannot take that loss from the model's own forward (no `logits_to_keep` to skip its logits, or
    no `router_aux_loss_coef`)."""
    import inspect

    if not getattr(model.config, "output_router_logits", False):
        return False
    if "logits_to_keep" in inspect.signature(model.forward).parameters and hasattr(model, "router_aux_loss_coef"):
        return True
    return None


def chunked_forward(model, input_ids, labels, chunk: int, **kwargs):
    """The causal LM's output with its loss from the head a chunk at a time. A mixture of experts
    whose forward adds its routers' load-balancing loss runs its own forward for it (with one
    position's logits: the loss comes from the recorded router logits, not the head), and that loss
    is added as its forward adds it: router_aux_loss_coef x aux_loss."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    head = model.get_output_embeddings()
    if not adds_router_loss(model):
        hidden = model.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        return CausalLMOutputWithPast(loss=causal_lm_loss(hidden, head, labels, chunk))
    seen = {}

    def keep(mod, args, out) -> None:  # returns None: the model's output stays as it is
        seen["hidden"] = out.last_hidden_state
    h = model.base_model.register_forward_hook(keep)
    try:
        out = model(input_ids=input_ids, logits_to_keep=1, **kwargs)
    finally:
        h.remove()
    loss = causal_lm_loss(seen["hidden"], head, labels, chunk)
    return CausalLMOutputWithPast(loss=loss + model.router_aux_loss_coef * out.aux_loss.to(loss.device))
