"""The overlap probe runs through the store on the given drive, reports a share, and leaves nothing."""
from tierlm.bench.overlap import bench_overlap


def test_overlap_probe_reports_a_share_and_cleans_up(tmp_path):
    r = bench_overlap(tmp_path, io_bytes=32 << 20, repeats=3)
    assert 0.0 <= r["overlap"] <= 1.0 and len(r["overlap_rounds"]) == 3
    assert r["overlap"] in r["overlap_rounds"] or round(r["overlap"], 3) in r["overlap_rounds"]
    assert r["overlap_io_bytes"] == 64 << 20 and r["overlap_io_s"] > 0 and r["overlap_compute_s"] > 0
    assert list(tmp_path.iterdir()) == []
