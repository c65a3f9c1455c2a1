"""`bench compute`'s probes: the decode probe runs the inference engine's own decode path, per weight
format; the layer probe times every shape in interleaved rounds."""
import torch

from tierlm.bench import measure
from tierlm.bench.measure import bench_decode
from tierlm.infer import native
from tierlm.infer.fused import FusedLayer


def test_decode_probe_times_each_format_on_the_engines_path(monkeypatch):
    calls = []
    real = FusedLayer.__call__
    monkeypatch.setattr(FusedLayer, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    r = bench_decode(hidden=256, total_bytes=4 << 20, repeats=2)
    assert set(r["decode_gbps"]) == {"bf16", "int8", "int4"} and all(v > 0 for v in r["decode_gbps"].values())
    assert r["decode_hidden"] == 256
    if native.available():
        assert r["decode_path"] == "fused" and calls  # the layers ran on the fused kernel
    else:
        assert r["decode_path"] == "per-product" and not calls


def test_layer_probe_interleaves_its_rounds_across_shapes(monkeypatch):
    # A slow spell of a few seconds must not cover every timing of one shape: round r of every
    # shape runs before round r + 1 of any.
    order = []
    real = measure._best
    monkeypatch.setattr(measure, "_best", lambda fn, repeats: order.append(fn) or real(fn, repeats))
    r = measure.bench_layer(torch.float32, repeats=3, widths=(128, 256), tokens=(256, 512))
    shapes = order[:4]
    assert len(set(shapes)) == 4 and order == shapes * 3
    assert set(r["layer_tflops_by_tokens"]) == {"256", "512"}
    assert all(set(row) == {"128", "256"} and min(row.values()) > 0 for row in r["layer_tflops_by_tokens"].values())
    assert r["layer_tflops"] == r["layer_tflops_by_tokens"]["512"] and r["layer_dtype"] == "fp32"
