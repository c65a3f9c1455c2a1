"""benchmarks/prefill_split.py: its kinds of work, on a tiny model's step through the engine."""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import prefill_split  # noqa: E402
from tierlm.hf.init import init_model  # noqa: E402
from tierlm.hf.presets import make_config  # noqa: E402
from tierlm.infer.engine import InferConfig, InferenceEngine  # noqa: E402


def test_kind_tells_the_elementwise_ops_apart_by_their_shapes():
    cfg = SimpleNamespace(intermediate_size=96)
    assert prefill_split.kind("aten::mm", [[8, 32], [32, 96]], cfg) == "products"
    assert prefill_split.kind("aten::_scaled_dot_product_flash_attention_for_cpu", [], cfg) == "attention"
    assert prefill_split.kind("aten::mul", [[1, 8, 32], [1, 8, 1]], cfg) == "norms"
    assert prefill_split.kind("aten::mul", [[32], [1, 8, 32]], cfg) == "norms"
    assert prefill_split.kind("aten::mul", [[1, 4, 8, 8], [1, 1, 8, 8]], cfg) == "rotary"
    assert prefill_split.kind("aten::mul", [[1, 8, 96], [1, 8, 96]], cfg) == "activation"
    assert prefill_split.kind("aten::add", [[1, 8, 32], [1, 8, 32], []], cfg) == "residual adds"
    assert prefill_split.kind("aten::copy_", [[1, 8, 32], [1, 8, 32], []], cfg) == "casts/copies"
    assert prefill_split.kind("aten::embedding", [[100, 32], [8]], cfg) == "other"


def test_split_of_a_step_counts_every_product_of_the_layers(tmp_path):
    config = make_config("llama", None, {"layers": 2})
    model = init_model(tmp_path / "model", config, dtype="bfloat16", tokenizer=False)
    eng = InferenceEngine(model, InferConfig(cpu_mem="2GiB", max_batch=1, max_seq_len=40, nvme_dir=str(tmp_path / "n")))
    threads = torch.get_num_threads()
    try:
        kinds, products = prefill_split.split(eng, list(range(3, 35)), config, rounds=1)
    finally:
        eng.close()
        torch.set_num_threads(threads)
    assert kinds["products"] > 0 and kinds["attention"] > 0
    # q, k, v, o, gate, up, down in each layer; the head keeps the last position only (one row: no mm)
    assert sum(p["calls"] for p in products) == 7 * 2
    assert all(p["shape"].startswith("[32, ") and p["gflops"] > 0 and p["bare_gflops"] > 0 for p in products)
