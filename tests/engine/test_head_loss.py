"""The head and loss a chunk at a time: HF's causal-LM loss and its gradients, without whole logits."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tierlm.engine.head_loss import causal_lm_loss
from tierlm.plan.budget import CHUNK_ABOVE, MIN_CHUNK_TOKENS, chunk_tokens

from .test_exactness import batches, run_engine, run_reference


def hf_loss(hidden, head, labels):
    logits = head(hidden).float()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 7, 64])
def test_loss_and_gradients_equal_hfs_within_rounding(chunk, bias):
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=bias).double()
    hidden = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 7))
    labels[0, 3] = labels[1, 0] = -100
    ref = hf_loss(hidden, head, labels)
    ref_grads = torch.autograd.grad(ref, [hidden, *head.parameters()])
    loss = causal_lm_loss(hidden, head, labels, chunk)
    grads = torch.autograd.grad(loss * 3.0, [hidden, *head.parameters()])  # a scaled loss scales them
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-7)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, 3.0 * r, rtol=1e-4, atol=1e-8)  # fp32 softmax in both


def test_no_counted_token_gives_zero_not_nan():
    head = nn.Linear(8, 10)
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    loss = causal_lm_loss(hidden, head, torch.full((1, 4), -100), 2)
    loss.backward()
    assert loss.item() == 0.0 and not hidden.grad.isnan().any()


def test_chunking_only_when_the_logits_are_large():
    assert chunk_tokens(128, 512, torch.float32) is None                   # tiny: HF's exact path
    per = 151936 * 16                                                     # Qwen2.5's vocabulary, fp32
    assert 896 * per > CHUNK_ABOVE and chunk_tokens(896, 151936, torch.float32) == MIN_CHUNK_TOKENS
    assert chunk_tokens(16384, 4096, torch.float32) == (64 << 20) // (4096 * 16)  # small rows: by bytes
    assert chunk_tokens(100, 512, torch.float32, forced=0) is None
    assert chunk_tokens(100, 512, torch.float32, forced=16) == 16
    assert chunk_tokens(10, 512, torch.float32, forced=16) is None        # one chunk is the whole


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's tiny config ties the head to the embedding
def test_engine_with_chunks_trains_like_torch(make_model_dir, tmp_path, arch):
    model_dir, model = make_model_dir(arch)
    data = batches(3)
    kw = dict(lr=1e-2, wd=0.1, clip=None, accum=1, warmup=1, precision="fp32")
    _, ref_master, ref_losses, _ = run_reference(model, data, **kw)
    masters, _, losses, _ = run_engine(model_dir, tmp_path, data, loss_chunk=5, **kw)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for n, t in ref_master.items():
        torch.testing.assert_close(masters[n], t, rtol=1e-4, atol=1e-5, msg=n)


def test_chunks_reuse_one_logits_buffer():
    """The fp32 logits and the rounded gradient live in buffers made once for every chunk: a fresh
    tensor a chunk is fresh pages the kernel zeroes. Counted with the profiler's allocations of a
    chunk's fp32 logits; the loop once made 7 a chunk, now 1 (logsumexp's own) and the buffer."""
    torch.manual_seed(0)
    vocab, chunk, chunks = 4096, 32, 8
    head = nn.Linear(16, vocab, bias=False).bfloat16()
    hidden = torch.randn(1, chunks * chunk, 16, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, chunks * chunk))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        causal_lm_loss(hidden, head, labels, chunk)
    fp32_chunk = chunk * vocab * 4
    made = sum(1 for e in prof.events() if e.cpu_memory_usage == fp32_chunk)
    assert made <= 2 * chunks + 1, f"{made} fp32 logits-sized tensors for {chunks} chunks"


@pytest.mark.parametrize("activations", ["keep", "recompute"])
def test_a_mixture_of_experts_in_chunks_keeps_its_routers_loss(tmp_path, activations):
    """Mixtral adds its routers' load-balancing loss (output_router_logits) to the loss; the chunked
    head takes it from the model's own forward, and its gradient reaches every layer's router in
    that layer's backward, weights kept or recomputed."""
    from transformers import AutoModelForCausalLM

    from tierlm.hf.init import init_model

    from ..families import family_config

    d = init_model(tmp_path / "m", family_config("mixtral", vocab_size=128), seed=2, tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(d).float()
    data = batches(2)
    kw = dict(lr=1e-2, wd=0.1, clip=None, accum=1, warmup=1, precision="fp32")
    _, ref_master, ref_losses, _ = run_reference(model, data, **kw)
    masters, _, losses, _ = run_engine(d, tmp_path, data, loss_chunk=5, activations=activations, **kw)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for n, t in ref_master.items():
        torch.testing.assert_close(masters[n], t, rtol=1e-4, atol=1e-5, msg=n)
    # without the routers' loss the routers would train differently: the check can fail
    model.config.output_router_logits = False
    _, plain_master, _, _ = run_reference(model, data, **kw)
    router = next(n for n in ref_master if n.endswith("mlp.gate.weight"))
    assert not torch.allclose(plain_master[router], ref_master[router], rtol=1e-4, atol=1e-5)


def _bf16_head_and_exact(vocab, batch, tokens, hidden=64):
    """A bf16 head, bf16 hidden states and labels, and the exact gradients of HF's loss on the same
    values in float64: (head, hidden, labels, d loss / d hidden, d loss / d weight)."""
    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=False).bfloat16()
    h = torch.randn(batch, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, tokens))
    exact_head = nn.Linear(hidden, vocab, bias=False).double()
    exact_head.weight.data.copy_(head.weight.data)
    exact_h = h.detach().double().requires_grad_(True)
    ref_grads = torch.autograd.grad(hf_loss(exact_h, exact_head, labels), [exact_h, exact_head.weight])
    return head, h, labels, *ref_grads


@pytest.mark.parametrize("chunk", [5, 64])
def test_bf16_chunks_take_the_weight_gradient_on_bf16_products_within_rounding(chunk):
    """In bf16 each chunk's head-weight gradient is a bf16 product (in slices of rows that fit the
    chunk's fp32 logits buffer: 20 slices of 15 rows at 5 tokens here), summed in fp32: within bf16
    rounding of the exact gradient, as HF's bf16 path is."""
    head, hidden, labels, *ref_grads = _bf16_head_and_exact(300, 2, 40)
    bf_grads = torch.autograd.grad(hf_loss(hidden, head, labels), [hidden, head.weight])  # HF's bf16 path
    grads = torch.autograd.grad(causal_lm_loss(hidden, head, labels, chunk), [hidden, head.weight])
    for g, bf, r in zip(grads, bf_grads, ref_grads):
        assert g.dtype == torch.bfloat16
        err, hf_err = ((x.double() - r).norm() / r.norm() for x in (g, bf))
        assert err < 1e-2 and err <= 2 * hf_err + 1e-3, (err, hf_err)


def test_bf16_one_token_chunks_of_a_vocabulary_narrower_than_the_hidden_size():
    """A chunk's fp32 logits buffer (1 x 10 here) cannot hold a slice of the 64-wide product: the
    weight gradient takes a temporary of one slice instead (it raised a shape error)."""
    head, hidden, labels, _, ref = _bf16_head_and_exact(10, 1, 6)
    got = torch.autograd.grad(causal_lm_loss(hidden, head, labels, 1), [head.weight])[0]
    assert (got.double() - ref).norm() / ref.norm() < 1e-2
