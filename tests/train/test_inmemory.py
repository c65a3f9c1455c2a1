"""The in-memory reference's per-step record: the same CPU counters as the out-of-core run's."""
import json

from tierlm.train import inmemory


def test_each_step_records_its_cpu_seconds_by_thread(tiny, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "mem.json"
    inmemory.main([str(tiny), "--data", str(data), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                   "--precision", "fp32", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r["cpu_s"]) <= {"main", "torch_threads", "other", "exited"}, r["cpu_s"]
    # the layers' Python and products run on the main thread (counted in 10 ms ticks: the first
    # step, which loads the kernels, takes several)
    assert rows[0]["cpu_s"].get("main", 0) > 0, rows
