"""The weight window's size: what a step's cycle of blocks needs, not prefetch + 2 of the largest."""
import pytest
import torch

from tierlm.plan.budget import TRAINING_RESERVE, Needs, plan_split, window_size
from tierlm.storage import BudgetError

MB = 1 << 20


def qwen_like(layers=24, tied=True):
    """A 545 MB embedding and 60 MB layers, like Qwen2.5-0.5B in fp32."""
    head = {"emb": 545 * MB, "norm": 1} if tied else {"lm_head": 545 * MB, "norm": 1}
    return [{"emb": 545 * MB}] + [{f"l{i}": 60 * MB} for i in range(layers)] + [head]


def test_equal_blocks_need_prefetch_plus_two_of_them():
    blocks = [{"e": 10}] + [{f"l{i}": 10} for i in range(8)] + [{"h": 10}]
    assert window_size(blocks, 2) == (40, 20)
    assert window_size(blocks, 4) == (60, 20)


def test_one_large_block_is_counted_once_beside_its_neighbours():
    want, floor = window_size(qwen_like(), 2)
    assert want == 545 * MB + 3 * 60 * MB + 1  # the head (tied: the embedding's matrix) and 3 layers
    assert floor == 545 * MB + 60 * MB + 1


def test_untied_embedding_and_head_are_never_neighbours():
    want, _ = window_size(qwen_like(tied=False), 2)
    assert want == 545 * MB + 3 * 60 * MB + 1
    # a one-layer model: the cycle embed, layer, head, layer holds both large blocks at once
    want, _ = window_size(qwen_like(layers=1, tied=False), 2)
    assert want == 2 * 545 * MB + 60 * MB + 1


def test_what_the_window_does_not_need_goes_to_activations():
    common = dict(max_block_grad=60 * MB, optimizer_item=80 * MB, layer_act=100 * MB,
                  layer_input=4 * MB, n_layers=24, logits=200 * MB)
    small = plan_split(4200 * MB, 64 * MB, Needs(window=window_size(qwen_like(), 2), **common))
    old = plan_split(4200 * MB, 64 * MB, Needs(window=(4 * 545 * MB, 2 * 545 * MB), **common))
    assert small.window < old.window
    assert small.activations == 24 * 100 * MB  # every layer keeps its activations
    assert old.activations < 10 * 100 * MB     # fewer than half of them did
    assert small.activations + small.state_cache - old.activations - old.state_cache == old.window - small.window
    with pytest.raises(BudgetError, match="2 blocks of weights"):
        plan_split(700 * MB, 64 * MB, Needs(window=window_size(qwen_like(), 2), **common))


def test_the_embeddings_gradient_borrows_what_backward_has_freed():
    """A 545 MB embedding gradient beside 60 MB layers: the share holds the waiting gradients and a
    layer's; at the end of backward, waiting + the embedding's fit the share and the freed memory."""
    common = dict(optimizer_item=80 * MB, layer_act=100 * MB, layer_input=4 * MB,
                  n_layers=24, logits=200 * MB)
    win = window_size(qwen_like(), 2)
    old = plan_split(3840 * MB, 64 * MB, Needs(window=win, max_block_grad=545 * MB, **common))
    new = plan_split(3840 * MB, 64 * MB, Needs(window=win, max_block_grad=545 * MB, max_layer_grad=60 * MB, **common))
    assert old.grads == 2 * 545 * MB and old.pending_grads == 545 * MB
    assert new.grads == 605 * MB and new.activations == old.activations + 485 * MB
    for s in (old, new):
        freed = s.activations + 2 * 100 * MB + 24 * 4 * MB
        assert s.pending_grads + 545 * MB <= s.grads + freed
        assert s.pending_grads + 60 * MB <= s.grads
    # with little to free (a GPU holds the activations) the share holds it all, as before
    gpu = plan_split(3840 * MB, 64 * MB, Needs(window=win, max_block_grad=545 * MB, max_layer_grad=60 * MB,
                                               **{**common, "layer_act": 0, "layer_input": 0, "logits": 0}))
    assert gpu.grads == 2 * 545 * MB and gpu.pending_grads == 545 * MB


def test_a_held_gradient_is_compute_share_but_not_transient():
    """A tied head's gradient lives through backward: the compute share holds it, but it is no
    block's transient compute, the size of the heap's holes between HeapGuard's checks."""
    common = dict(max_block_grad=545 * MB, optimizer_item=80 * MB, layer_act=2 * MB,
                  layer_input=MB // 16, n_layers=24, logits=65 * MB, max_layer_grad=60 * MB)
    win = window_size(qwen_like(), 2)
    plain = plan_split(4096 * MB, 64 * MB, Needs(window=win, **common))
    held = plan_split(4096 * MB, 64 * MB, Needs(window=win, held_grad=545 * MB, **common))
    assert held.compute == plain.compute + 545 * MB and held.held_grad == 545 * MB
    assert held.transient == plain.transient == plain.compute == 2 * 2 * MB + 65 * MB + TRAINING_RESERVE


def test_room_the_whole_state_leaves_keeps_the_weights():
    """Once the state cache holds all the optimizer state, what is left goes to the window, up to
    every weight (it keeps them between steps); a tight budget, or the cache off, changes nothing."""
    common = dict(max_block_grad=60 * MB, optimizer_item=80 * MB, layer_act=100 * MB,
                  layer_input=4 * MB, n_layers=24, logits=200 * MB, window=window_size(qwen_like(), 2))
    state, weights = 6000 * MB, 1500 * MB
    off = plan_split(10240 * MB, 64 * MB, Needs(**common))
    big = plan_split(10240 * MB, 64 * MB, Needs(state_total=state, weights_total=weights, **common))
    assert big.state_cache == state and 0 < big.weights_kept < weights  # some of the weights
    assert big.weights_kept == big.window - off.window
    assert big.window + big.state_cache == off.window + off.state_cache
    huge = plan_split(24576 * MB, 64 * MB, Needs(state_total=state, weights_total=weights, **common))
    assert huge.weights_kept == weights and huge.state_cache > state
    for budget in (4096 * MB, 8192 * MB):  # the state does not fit: the window keeps its size
        tight = plan_split(budget, 64 * MB, Needs(state_total=state, weights_total=weights, **common))
        assert tight.weights_kept == 0 and tight == plan_split(budget, 64 * MB, Needs(**common))
    assert plan_split(24576 * MB, 64 * MB, Needs(state_total=None, weights_total=weights, **common)).weights_kept == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_kernel_warm_up_runs_one_layer_and_the_engines_head(arch, monkeypatch):
    """library_baseline's warm-up (run on a GPU: CUDA loads a kernel's module into host memory on
    first use) is a one-layer model of the real config at the real batch, its loss through the
    engine's chunked head where the engine would chunk; checked here on the CPU for each family."""
    from tierlm.engine import baseline
    from tierlm.plan import budget as B

    from ..conftest import tiny_config

    monkeypatch.setattr(B, "CHUNK_ABOVE", 0)
    monkeypatch.setattr(B, "MIN_CHUNK_TOKENS", 4)
    monkeypatch.setattr(B, "CHUNK_TARGET", 1)
    calls = []
    real = baseline.causal_lm_loss
    monkeypatch.setattr(baseline, "causal_lm_loss", lambda h, head, labels, chunk: calls.append(
        (tuple(h.shape), chunk)) or real(h, head, labels, chunk))
    cfg = tiny_config(arch, **({"n_layer": 3} if arch == "gpt2" else {"num_hidden_layers": 3}))
    baseline.warm_kernels(cfg, torch.bfloat16, "cpu", (2, 16))
    assert calls == [((2, 16, 64), 4)]
    assert cfg.num_hidden_layers == 3  # the caller's config is not changed


def test_layer_inputs_are_counted_apart_from_the_activations_share():
    """Every policy holds the layer inputs (a recomputed layer restarts from its input; a kept or
    swapped layer's graph holds its input and output in RAM): the split names them once, so the
    activations' share and everything else add up to the budget."""
    common = dict(max_block_grad=60 * MB, optimizer_item=80 * MB, layer_act=100 * MB,
                  layer_input=16 * MB, n_layers=24, logits=200 * MB, window=window_size(qwen_like(), 2))
    for budget in (1800 * MB, 2500 * MB):
        s = plan_split(budget, 64 * MB, Needs(**common))
        assert 0 < s.activations < 24 * 100 * MB
        assert (s.baseline + s.window + s.optimizer + s.grads + s.compute + s.activations + s.state_cache
                + 24 * 16 * MB) == budget


def _layer_saved_bytes(cfg, seq: int, dtype) -> int:
    """What one decoder layer of `cfg` saves for backward at `seq` tokens (training mode), as autograd's
    saved-tensor hooks see it, parameters left out."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_config(cfg).to(dtype).train()
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = torch.randn(1, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    pos = torch.arange(seq)[None]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m.model.layers[0](x, position_embeddings=m.model.rotary_emb(x, pos), position_ids=pos, attention_mask=None)
    return sum(b for p, b in seen.items() if p not in params)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_activation_estimate_holds_on_either_attention_path(dropout, dtype):
    """SDPA runs its fused CPU kernel (a logsumexp saved) unless dropout is on, where its math path
    saves the seq x seq scores of every head: the estimate counts the path the model will take, and
    is an upper bound of what autograd saves on both (measured here at 512 tokens)."""
    from tierlm.plan.budget import flash_attention, layer_activation_bytes
    from tierlm.hf.presets import make_config
    cfg = make_config("llama", None, {"layers": 1, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256,
                                      "vocab": 512, "max_positions": 512})
    cfg.attention_dropout = dropout
    assert flash_attention(cfg) == (dropout == 0.0)
    saved, est = _layer_saved_bytes(cfg, 512, dtype), layer_activation_bytes(cfg, 512, dtype)
    assert saved <= est <= 1.25 * saved
    scores = 4 * 512 * 512 * 4  # one fp32 copy of every head's scores
    assert (saved > 3 * scores) == (dropout > 0)


def test_kernel_scratch_is_counted_per_thread():
    """The kernels' per-thread buffers (the fused attention's blocks, the products' packing) grow
    with the thread count: a 64-thread machine holds 32 times what 2 threads do."""
    from tierlm.plan.budget import kernel_scratch_bytes
    from tierlm.hf.presets import make_config
    cfg = make_config("llama", None, {"layers": 1, "hidden": 1024, "intermediate": 2816})
    two = kernel_scratch_bytes(cfg, 4096, torch.bfloat16, threads=2)
    assert kernel_scratch_bytes(cfg, 4096, torch.bfloat16, threads=64) == 32 * two
    # bf16 backward: 256 x 512 blocks of scores and their gradient, fp32 and bf16, and the packing
    assert two == 2 * (256 * 512 * 12 + (1 << 20))
    assert kernel_scratch_bytes(cfg, 4096, torch.float32, threads=2) == 2 * (256 * 512 * 8 + (1 << 20))


def test_swapping_stages_in_host_ram_not_in_the_gpus_allowance():
    """On the CPU a swapped layer is staged in the activations' share; on a GPU the staging pool is
    pinned host RAM, so a swap policy asks nothing of the device's allowance."""
    from types import SimpleNamespace

    from tierlm.engine.budget_plan import check_kept
    from tierlm.storage import BudgetError

    def eng(on_gpu):
        return SimpleNamespace(on_gpu=on_gpu, cfg=SimpleNamespace(activations="swap", cpu_mem=64 * MB))
    check_kept(eng(True), 4, 10 * MB, 5 * MB, lambda b: b)
    with pytest.raises(BudgetError, match="swapping stages one layer's"):
        check_kept(eng(False), 4, 10 * MB, 5 * MB, lambda b: b // 4)
