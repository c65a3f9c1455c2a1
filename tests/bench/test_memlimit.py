"""benchmarks/peers/memlimit.py (a memory cgroup that counts the page cache) and the pieces of
benchmarks/moe_decode.py and peers/llamacpp.py that need no llama.cpp build and no model."""
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peers import llamacpp, memlimit  # noqa: E402

MIB = 1 << 20


def _controller_or_skip():
    try:
        ctl = memlimit.controller()
        with memlimit.MemoryLimit(16 * MIB, ctl):
            pass
    except memlimit.Unavailable as e:
        pytest.skip(f"this machine allows no memory limit: {e}")
    return ctl


def test_parse_bytes():
    assert memlimit.parse_bytes("2GiB") == 2 << 30
    assert memlimit.parse_bytes("2.5G") == int(2.5 * (1 << 30))
    assert memlimit.parse_bytes("512MiB") == 512 * MIB
    assert memlimit.parse_bytes("1GB") == 10**9
    assert memlimit.parse_bytes(4096) == 4096
    for bad in ("", "GiB", "2 parsecs", "1XB"):
        with pytest.raises(ValueError):
            memlimit.parse_bytes(bad)


_READER = """
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print(sum(m[i] for i in range(0, len(m), 4096)))
"""


def test_a_mapped_file_larger_than_the_limit_is_read_within_it(tmp_path):
    """The page cache counts: reading a 96 MiB mapped file in a 32 MiB group succeeds (file pages are
    reclaimed) with the group's peak at most the limit, and most of the file is no longer cached."""
    ctl = _controller_or_skip()
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(96 * MIB))
    memlimit.evict(f)
    with memlimit.MemoryLimit("32MiB", ctl) as g:
        p = g.run([sys.executable, "-c", _READER, str(f)], capture_output=True, text=True)
        st = g.stats()
    assert p.returncode == 0, p.stderr
    assert int(p.stdout) == sum(f.read_bytes()[::4096])
    assert st["limit"] == 32 * MIB and 16 * MIB < st["peak"] <= 32 * MIB
    assert st["oom_kills"] == 0


def test_memory_it_cannot_reclaim_past_the_limit_is_killed():
    ctl = _controller_or_skip()
    grab = "b = bytearray(128 << 20); b[::4096] = b'x' * len(b[::4096]); print('survived')"
    with memlimit.MemoryLimit("48MiB", ctl) as g:
        p = g.run([sys.executable, "-c", grab], capture_output=True, text=True)
        st = g.stats()
    assert p.returncode != 0 and "survived" not in p.stdout
    assert st["oom_kills"] >= 1 and st["peak"] <= 48 * MIB


def test_cli_reports_the_peak_and_passes_the_exit_status(capsys):
    _controller_or_skip()
    rc = memlimit.main(["--limit", "64MiB", "--", sys.executable, "-c", "raise SystemExit(3)"])
    assert rc == 3
    assert "limit 64 MiB, peak" in capsys.readouterr().err


_FAKE_BENCH = """#!/bin/sh
# a stand-in llama-bench: records its arguments, prints one JSON result
echo "$@" >> "$(dirname "$0")/calls"
echo '[{"model_type": "qwen3moe 30B.A3B BF16", "avg_ts": 12.5, "stddev_ts": 0.5,
        "build_commit": "abc1234", "build_number": 1, "cpu_info": "cpu", "backends": "CPU"}]'
"""


def test_measure_passes_extra_arguments_and_runs_through_wrap(tmp_path):
    bench = tmp_path / "llama-bench"
    bench.write_text(_FAKE_BENCH)
    bench.chmod(0o755)
    peer = llamacpp.LlamaCpp(bench, bench, None)
    wrapped = []

    def wrap(cmd):
        wrapped.append(cmd)
        return ["/bin/sh", "-c", 'exec "$@"', "sh", *cmd]
    r = llamacpp.measure(peer, Path("m.gguf"), 16, 4, 2, reps=1, extra=("-lm", "none"), wrap=wrap)
    assert r["decode_tok_s"] == 12.5 and r["prefill_tok_s_sd"] == 0.5 and r["build"] == "abc1234 (build 1)"
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 == len(wrapped) and all(c.endswith("-lm none") for c in calls)
    assert "-d 16" in calls[1] and r["commands"] == wrapped


def test_moe_decode_table_and_child_output():
    import moe_decode
    ok = {"prefill_tok_s": 50.0, "prefill_tok_s_sd": 1.0, "decode_tok_s": 4.0, "decode_tok_s_sd": 0.1}
    cg = {"peak": 3 << 30, "oom_kills": 0}
    rows = [{"format": "bf16", "llama.cpp": {"unlimited": ok, "limited": {**ok, "cgroup": cg},
                                             "limited_no_mmap": {"error": "killed", "cgroup": {**cg, "oom_kills": 1}}},
             "tierlm": {**ok, "cpu_mem": "2.75GiB", "cgroup": cg, "expert_cache": {"hit_rate": 0.625}}}]
    head, _, *lines = moe_decode.table(rows, 3 << 30)
    assert "cgroup peak" in head and len(lines) == 4
    assert "| llama.cpp | BF16 | no limit | 50.0 ± 1.0 | 4.00 ± 0.10 | — |" in lines[0]
    assert "3.00 GiB, 1 OOM kill" in lines[2] and "killed at the limit" in lines[2]
    assert "--cpu-mem 2.75GiB" in lines[3] and "hit rate 62.5%" in lines[3]
    out = "loading\n" + json.dumps({"decode_tok_s": 1.5}) + "\n"
    assert moe_decode._last_json(out) == {"decode_tok_s": 1.5} and moe_decode._last_json("no json") is None


def test_moe_decode_refuses_a_model_made_with_another_init(tmp_path):
    import moe_decode
    config = moe_decode.model_config("qwen3-30b-a3b", 2, 5e-4)
    assert config.initializer_range == 5e-4 and config.num_hidden_layers == 2
    (tmp_path / "config.json").write_text(json.dumps({"initializer_range": 0.02}))
    with pytest.raises(SystemExit, match="initializer_range 0.02"):
        moe_decode.ensure_model(tmp_path, config)
