"""The weight window's size: what a step's cycle of blocks needs, not prefetch + 2 of the largest."""
import pytest
import torch

from tierlm.engine.budget import plan_split, window_size
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
    common = dict(baseline=64 * MB, max_block_grad=60 * MB, optimizer_item=80 * MB, layer_act=100 * MB,
                  layer_input=4 * MB, n_layers=24, logits=200 * MB)
    small = plan_split(4200 * MB, window_size=window_size(qwen_like(), 2), **common)
    old = plan_split(4200 * MB, window_size=(4 * 545 * MB, 2 * 545 * MB), **common)
    assert small.window < old.window
    assert small.activations == 24 * 100 * MB  # every layer keeps its activations
    assert old.activations < 10 * 100 * MB     # fewer than half of them did
    assert small.activations + small.state_cache - old.activations - old.state_cache == old.window - small.window
    with pytest.raises(BudgetError, match="2 blocks of weights"):
        plan_split(700 * MB, window_size=window_size(qwen_like(), 2), **common)


def test_the_embeddings_gradient_borrows_what_backward_has_freed():
    """A 545 MB embedding gradient beside 60 MB layers: the share holds the waiting gradients and a
    layer's; at the end of backward, waiting + the embedding's fit the share and the freed memory."""
    common = dict(baseline=64 * MB, optimizer_item=80 * MB, layer_act=100 * MB, layer_input=4 * MB,
                  n_layers=24, logits=200 * MB)
    win = window_size(qwen_like(), 2)
    old = plan_split(3840 * MB, window_size=win, max_block_grad=545 * MB, **common)
    new = plan_split(3840 * MB, window_size=win, max_block_grad=545 * MB, max_layer_grad=60 * MB, **common)
    assert old.grads == 2 * 545 * MB and old.pending_grads == 545 * MB
    assert new.grads == 605 * MB and new.activations == old.activations + 485 * MB
    for s in (old, new):
        freed = s.activations + 2 * 100 * MB + 24 * 4 * MB
        assert s.pending_grads + 545 * MB <= s.grads + freed
        assert s.pending_grads + 60 * MB <= s.grads
    # with little to free (a GPU holds the activations) the share holds it all, as before
    gpu = plan_split(3840 * MB, window_size=win, max_block_grad=545 * MB, max_layer_grad=60 * MB,
                     **{**common, "layer_act": 0, "layer_input": 0, "logits": 0})
    assert gpu.grads == 2 * 545 * MB and gpu.pending_grads == 545 * MB


def test_a_held_gradient_is_compute_share_but_not_transient():
    """A tied head's gradient lives through backward: the compute share holds it, but it is no
    block's transient compute, the size of the heap's holes between HeapGuard's checks."""
    common = dict(baseline=64 * MB, max_block_grad=545 * MB, optimizer_item=80 * MB, layer_act=2 * MB,
                  layer_input=MB // 16, n_layers=24, logits=65 * MB, max_layer_grad=60 * MB)
    win = window_size(qwen_like(), 2)
    plain = plan_split(4096 * MB, window_size=win, **common)
    held = plan_split(4096 * MB, window_size=win, held_grad=545 * MB, **common)
    assert held.compute == plain.compute + 545 * MB and held.held_grad == 545 * MB
    assert held.transient == plain.transient == plain.compute == 2 * 2 * MB + 65 * MB + (24 << 20)


def test_room_the_whole_state_leaves_keeps_the_weights():
    """Once the state cache holds all the optimizer state, what is left goes to the window, up to
    every weight (it keeps them between steps); a tight budget, or the cache off, changes nothing."""
    common = dict(baseline=64 * MB, max_block_grad=60 * MB, optimizer_item=80 * MB, layer_act=100 * MB,
                  layer_input=4 * MB, n_layers=24, logits=200 * MB, window_size=window_size(qwen_like(), 2))
    state, weights = 6000 * MB, 1500 * MB
    off = plan_split(10240 * MB, **common)
    big = plan_split(10240 * MB, state_total=state, weights_total=weights, **common)
    assert big.state_cache == state and 0 < big.weights_kept < weights  # some of the weights
    assert big.weights_kept == big.window - off.window
    assert big.window + big.state_cache == off.window + off.state_cache
    huge = plan_split(24576 * MB, state_total=state, weights_total=weights, **common)
    assert huge.weights_kept == weights and huge.state_cache > state
    for budget in (4096 * MB, 8192 * MB):  # the state does not fit: the window keeps its size
        tight = plan_split(budget, state_total=state, weights_total=weights, **common)
        assert tight.weights_kept == 0 and tight == plan_split(budget, **common)
    assert plan_split(24576 * MB, state_total=None, weights_total=weights, **common).weights_kept == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_kernel_warm_up_runs_one_layer_and_the_engines_head(arch, monkeypatch):
    """library_baseline's warm-up (run on a GPU: CUDA loads a kernel's module into host memory on
    first use) is a one-layer model of the real config at the real batch, its loss through the
    engine's chunked head where the engine would chunk; checked here on the CPU for each family."""
    from tierlm.engine import budget as B
    from tierlm.engine import head_loss

    from ..conftest import tiny_config

    monkeypatch.setattr(head_loss, "CHUNK_ABOVE", 0)
    monkeypatch.setattr(head_loss, "MIN_CHUNK_TOKENS", 4)
    monkeypatch.setattr(head_loss, "CHUNK_TARGET", 1)
    calls = []
    real = head_loss.causal_lm_loss
    monkeypatch.setattr(head_loss, "causal_lm_loss", lambda h, head, labels, chunk: calls.append(
        (tuple(h.shape), chunk)) or real(h, head, labels, chunk))
    cfg = tiny_config(arch, **({"n_layer": 3} if arch == "gpt2" else {"num_hidden_layers": 3}))
    B.warm_kernels(cfg, torch.bfloat16, "cpu", (2, 16))
    assert calls == [((2, 16, 64), 4)]
    assert cfg.num_hidden_layers == 3  # the caller's config is not changed
