"""An inference run's compute scratch (plan.inference.scratch_bytes) counts the fp32 copy that a
many-row product of converted weights keeps (infer.fp32_product)."""
from types import SimpleNamespace

import pytest

from tierlm.plan import inference
from tierlm.plan.inference import InferConfig, largest_matrix, scratch_bytes

CONFIG = SimpleNamespace(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=4096)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bf16_weights_count_a_converted_matrix_only_where_bf16_products_are_slow(monkeypatch, fast_bf16):
    monkeypatch.setattr(inference, "cpu_has_bf16_matmul", lambda: fast_bf16)
    base = scratch_bytes(CONFIG, InferConfig(dtype="fp32"), 64)
    bf16 = scratch_bytes(CONFIG, InferConfig(dtype="bf16"), 64)
    assert bf16 - base == (0 if fast_bf16 else 4 * 704 * 256)  # the MLP's widest matrix in fp32
    # int4 converts its matrices to fp32 on any CPU (and its head, bf16, with the rest where slow)
    assert scratch_bytes(CONFIG, InferConfig(dtype="bf16", weights="int4"), 64) - base == 4 * 704 * 256
    assert scratch_bytes(CONFIG, InferConfig(dtype="bf16", device="cuda"), 64) == base  # the GPU computes


def test_sixteen_rows_decoding_together_convert_the_head_too():
    from tierlm.infer.gemv import UPCAST_MIN_ROWS
    assert largest_matrix(CONFIG, UPCAST_MIN_ROWS - 1) == 704 * 256
    assert largest_matrix(CONFIG, UPCAST_MIN_ROWS) == 4096 * 256


def test_the_steps_masks_are_counted_and_made_additive_where_attention_runs_eager():
    """A step's boolean masks (one a kind of layer) and, where the model's eager attention runs
    (no SDPA, or sparse attention: infer.packed.runs_eager), their additive copies in fp32 beside
    the scores, their softmax and its cast."""
    cfg = InferConfig(dtype="fp32", max_batch=2, step_tokens=32, packed=False)
    tokens, keys = 2 * 32, 65
    scores = tokens * 4 * keys * 4
    plain = scratch_bytes(CONFIG, cfg, 64)
    assert scratch_bytes(CONFIG, cfg, 64, eager=True) - plain == 2 * scores + 4 * tokens * keys
    slid = SimpleNamespace(**vars(CONFIG), layer_types=["sliding_attention", "full_attention"] * 2)
    assert scratch_bytes(slid, cfg, 64) - plain == tokens * keys               # a second mask
    assert scratch_bytes(slid, cfg, 64, eager=True) - scratch_bytes(CONFIG, cfg, 64, eager=True) == 5 * tokens * keys
