"""`bench compute`'s decode probe runs the inference engine's own decode path, per weight format."""
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
