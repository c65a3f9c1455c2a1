"""`tierlm plan` and `tierlm bench` end to end (in process; bench with tiny sizes, never timed)."""
import json

import pytest

from tierlm.cli import main


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """A cached measurement, so `--hardware this` never profiles inside the tests."""
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "bench.json").write_text(json.dumps({
        "io": {"dir": str(tmp_path), "direct_io": True, "read_gbps": 1.0, "write_gbps": 1.0, "mem_gbps": 6.0,
               "free_bytes": 100 << 30, "block_bytes": 16 << 20, "inflight": 4, "bytes": 1 << 30, "note": None},
        "compute": {"matmul_tflops": {"float32": 0.04, "bfloat16": 0.12, "float16": 0.06},
                    "adamw_elems_per_s": 5e8, "matmul_n": 2048, "threads": 2},
        "machine": {"cores": 2, "logical_cpus": 2, "ram_bytes": 24 << 30, "torch": "x", "when": "test"}}))
    return tmp_path


def test_plan_prints_placement_binding_cost_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "p.json"
    assert main(["plan", "gpt3-175b", "--hardware", "lohan", "--batch", "16", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for words in ("fits: yes", "placement:", "binding:", "TFLOPS", "per million trained tokens", "assumptions:"):
        assert words in out
    data = json.loads(out_json.read_text())
    assert data["binding"] in data["devices_s"] and data["cost"]["usd_per_million_tokens"] > 0


def test_plan_json_logs_the_config_it_ran_with(tmp_path, capsys):
    """flag = --config key = logged value: the --json holds the options under the flags' names, the
    file's and the flags' merged; with --compare, each ranked plan holds them."""
    from tierlm.advise.options import PlanConfig
    from tierlm.cli import build_parser
    from tierlm.config import from_args, to_dict

    f = tmp_path / "plan.toml"
    f.write_text('model = "gpt3-175b"\nbatch = 16\nclip = "redo"\nstate_cache = false\n')
    argv = ["plan", "--config", str(f), "--hardware", "lohan", "--seq-len", "512", "--json", str(tmp_path / "p.json")]
    assert main(argv) == 0
    logged = json.loads((tmp_path / "p.json").read_text())["config"]
    assert logged == to_dict(from_args(PlanConfig, build_parser().parse_args(argv)))
    assert (logged["batch"], logged["seq_len"], logged["clip"], logged["state_cache"]) == (16, 512, "redo", False)
    argv = ["plan", "llama-3.1-8b", "--task", "serve", "--compare", "h100-server,cpu-4s-ddr5",
            "--chart", str(tmp_path / "c.png"), "--json", str(tmp_path / "c.json")]
    assert main(argv) == 0
    ranked = json.loads((tmp_path / "c.json").read_text())
    assert len(ranked) == 2 and all(r["config"] == to_dict(from_args(PlanConfig, build_parser().parse_args(argv)))
                                    for r in ranked)
    capsys.readouterr()


def test_plan_infeasible_exits_1_and_explains(capsys):
    assert main(["plan", "gpt3-175b", "--hardware", "lohan", "--batch", "64"]) == 1
    assert "more than its 24.00 GiB" in capsys.readouterr().out


def test_compare_ranks_and_draws(tmp_path, capsys):
    png = tmp_path / "c.png"
    assert main(["plan", "llama-3.1-8b", "--task", "serve", "--batch", "8",
                 "--compare", "4090-workstation,h100-server,cpu-4s-ddr5,a100-80g+64GiB", "--chart", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") >= 5 and "$/M tokens" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_on_this_machine_uses_measurements(measured, capsys, make_model_dir):
    d, _ = make_model_dir("llama")
    assert main(["plan", str(d), "--hardware", "this", "--batch", "2", "--seq-len", "32", "--no-state-cache"]) == 0
    out = capsys.readouterr().out
    assert "measured by `tierlm bench`" in out and "cost: hardware n/a" in out
    assert "run `tierlm bench compute` again" in out  # an old cache: said, not silently re-measured
    # the model's own step through the engine, at the plan's micro-batch (64 tokens), measured and used
    assert "this model's own step run by the engine here (llama code from transformers, 2 of its layers" in out


def test_plan_falls_back_to_the_bare_layer_where_the_engine_cannot_run_the_step(measured, capsys, make_model_dir,
                                                                              monkeypatch):
    """The engine probe failing (here: raising) leaves the bare layer's probe, said, and cached as such."""
    from tierlm.bench import model_step

    def refuse(*a, **k):
        raise ValueError("no room")
    monkeypatch.setattr(model_step, "bench_engine_step", refuse)
    bare = []
    monkeypatch.setattr(model_step, "bench_model_step", lambda config, tokens, seq, dtype: bare.append(tokens) or {
        "layer_s": 0.1, "rest_s": 0.2, "tokens": tokens, "probed_tokens": tokens, "seq": seq, "dtype": "bfloat16",
        "threads": 2, "model_type": config.model_type})
    d, _ = make_model_dir("llama")
    assert main(["plan", str(d), "--hardware", "this", "--batch", "2", "--seq-len", "32"]) == 0
    out = capsys.readouterr()
    assert bare == [64] and "the engine could not run this model's step (ValueError: no room)" in out.err
    assert "this model's own step measured here (llama code from transformers" in out.out


def test_serving_weights_format_is_a_flag(tmp_path, capsys, monkeypatch):
    out = {}
    for fmt in ("bf16", "int4"):
        j = tmp_path / f"{fmt}.json"
        assert main(["plan", "llama-3.1-70b", "--task", "serve", "--weights", fmt, "--hardware", "cpu-2s-genoa",
                     "--json", str(j)]) == 0
        assert f"{fmt} weights" in capsys.readouterr().out
        out[fmt] = json.loads(j.read_text())
    assert out["int4"]["task"]["weights"] == "int4"
    assert out["int4"]["extra"]["decode_tokens_per_s"] > 2 * out["bf16"]["extra"]["decode_tokens_per_s"]
    # fine-tuning keeps its own weights: said before `--hardware this` (the default) measures anything
    from tierlm.advise import command
    monkeypatch.setattr(command, "measured_this", lambda *a, **k: pytest.fail("measured before the flag was checked"))
    assert main(["plan", "gpt2", "--weights", "int8"]) == 2
    assert "--weights int8 is for --task serve" in capsys.readouterr().err


def test_bad_hardware_is_a_usage_error(capsys):
    assert main(["plan", "gpt2", "--hardware", "rtx9999"]) == 2
    err = capsys.readouterr().err
    assert "unknown part 'rtx9999'" in err and "rtx4090" in err


def test_bad_model_is_a_usage_error(capsys):
    assert main(["plan", "no-such-model", "--hardware", "lohan"]) == 2
    assert "presets:" in capsys.readouterr().err


def test_bench_runs_small_and_caches(tmp_path, monkeypatch, capsys):
    from tierlm.bench import cache, measure

    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    io = measure.bench_io(tmp_path / "nvme", size_bytes=16 << 20, block_bytes=4 << 20, inflight=2)
    assert io["read_gbps"] > 0 and io["write_gbps"] > 0 and not list((tmp_path / "nvme").iterdir())
    comp = measure.bench_compute(seconds_per_dtype=0.01, n=128)
    assert set(comp["matmul_tflops"]) == {"float32", "bfloat16", "float16"}
    cache.update("compute", comp)
    assert cache.load()["compute"]["adamw_elems_per_s"] > 0
    assert main(["bench", "io", "--nvme", str(tmp_path / "nvme2"), "--size", "8MiB"]) == 0
    assert "read" in capsys.readouterr().out and (tmp_path / "nvme2" / "tierlm-bench.json").is_file()


def test_overhead_splits_per_step_and_per_layer(tmp_path, monkeypatch):
    """Slope and intercept of two depths (the engine runs themselves are the benchmark, not the test)."""
    from tierlm.bench import overhead

    monkeypatch.setattr(overhead, "_train_step_s", lambda n, root, steps, acts: 0.1 + n * (0.02 if acts == "keep" else 0.03))
    monkeypatch.setattr(overhead, "_decode_step_s", lambda n, root, steps, stream: 0.001 + n * (0.004 if stream else 0.0005))
    o = overhead.bench_overhead(tmp_path)
    assert o["train_per_layer_s"] == pytest.approx(0.02) and o["train_per_step_s"] == pytest.approx(0.1)
    assert o["train_per_layer_recompute_s"] == pytest.approx(0.03)
    assert o["decode_streamed_per_layer_s"] == pytest.approx(0.004)
    assert o["decode_resident_per_step_s"] == pytest.approx(0.001)
    assert not list(tmp_path.iterdir())  # its scratch directory is removed


def test_first_plan_on_this_machine_says_what_it_measures_and_for_how_long(tmp_path, monkeypatch, capsys):
    """Nothing cached: `--hardware this` measures, and first says so (what, about how long), one
    line per stage off a terminal. The measurements themselves are stand-ins: this is about words."""
    from tierlm.bench import measure, model_step, overhead, overlap

    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    io = {"dir": str(tmp_path), "direct_io": True, "read_gbps": 1.0, "write_gbps": 1.0, "free_bytes": 100 << 30,
          "block_bytes": 16 << 20, "inflight": 4, "bytes": 1 << 30, "note": None}
    sizes = []
    monkeypatch.setattr(measure, "bench_io", lambda d, size, *a, **k: sizes.append(size) or dict(io))
    monkeypatch.setattr(measure, "bench_queue_depth", lambda d, **k: sizes.append(k["size_bytes"]) or {"queue_depth": 2})
    monkeypatch.setattr(measure, "bench_block_size", lambda d, q, **k: sizes.append(k["size_bytes"]) or {"shard_bytes": 8 << 20})
    monkeypatch.setattr(measure, "bench_memory", lambda *a: {"mem_gbps": 6.0})
    monkeypatch.setattr(measure, "bench_compute", lambda: {"matmul_tflops": {"float32": 0.04, "bfloat16": 0.12},
                                                           "adamw_elems_per_s": 5e8, "threads": 2})
    for name in ("bench_layer", "bench_decode", "bench_checksum"):
        monkeypatch.setattr(measure, name, lambda: {})
    monkeypatch.setattr(overhead, "bench_overhead", lambda where: None)
    monkeypatch.setattr(overlap, "bench_overlap", lambda where: {})
    monkeypatch.setattr(model_step, "bench_engine_step", lambda config, tokens, seq, dtype, where, *a: {
        "layer_s": 0.1, "rest_s": 0.2, "step_s": 0.4, "layers": 2, "tokens": tokens, "probed_tokens": tokens,
        "seq": seq, "dtype": "bfloat16", "threads": 2, "model_type": config.model_type, "source": "engine",
        "steps": 4, "read_bytes": 0})
    monkeypatch.setattr(model_step, "bench_model_step", lambda config, tokens, seq, dtype, *a: {
        "layer_s": 0.1, "rest_s": 0.2, "model_s": 0.3, "tokens": tokens, "probed_tokens": tokens, "seq": seq,
        "dtype": "bfloat16", "threads": 2, "model_type": config.model_type})
    Usage = __import__("collections").namedtuple("Usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda p: Usage(8 << 30, 6 << 30, 2 << 30))
    assert main(["plan", "qwen2.5-0.5b", "--hardware", "this", "--batch", "1", "--seq-len", "64"]) == 0
    err = capsys.readouterr().err
    assert "nothing measured on this machine yet" in err
    assert "bench io: measures sequential write and read" in err and "about" in err
    assert "bench compute: measures matmul per dtype" in err and "[2/6] decoder layers" in err
    # the two-layer copy's store (4.64 GiB) is more than half the 2 GiB free: the layer alone, and why
    assert "plan: measures this model's own decoder layer, forward and backward (qwen2 code, 64 tokens" in err
    assert "its step through the engine would take about" in err and "4.64 GiB of .'s 2.00 GiB free" in err
    assert max(sizes) <= (2 << 30) // 8  # at most an eighth of the free space on the drive measured
    # measured once: the next plan prints no such line
    assert main(["plan", "qwen2.5-0.5b", "--hardware", "this", "--batch", "1", "--seq-len", "64"]) == 0
    assert "measures" not in capsys.readouterr().err


def test_serve_plan_on_this_machine_measures_the_models_own_decode(measured, capsys, make_model_dir, monkeypatch):
    from tierlm.bench import measure

    seen = []
    monkeypatch.setattr(measure, "bench_decode", lambda formats, config=None: seen.append((formats, config.model_type))
                        or {"decode_gbps": {f: 2.5 for f in formats}})
    d, _ = make_model_dir("llama")
    args = ["plan", str(d), "--hardware", "this", "--task", "serve", "--weights", "int8", "--json", str(d / "p.json")]
    assert main(args) == 0
    out = capsys.readouterr()
    assert seen == [(("int8", "bf16"), "llama")]  # the head is bf16 whatever the layers
    assert "this model's own decode step (llama code, int8 and bf16 weights" in out.err
    assert "decode rates measured on this model's own layers: int8 2.50 GB/s, bf16 2.50 GB/s" in out.out
    assert json.loads((d / "p.json").read_text())["hardware"]["rates"]["decode"]["int8"] == 2.5e9
    assert main(args) == 0 and len(seen) == 1  # cached
