"""The command line end to end: init, finetune, the demo, and bad input as clear errors (exit 2)."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from tierlm.cli import main


def tierlm(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "tierlm", *map(str, args)], capture_output=True, text=True)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def _data(path, lines):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return path


def test_finetune_writes_run_directory_and_loadable_model(tiny, tmp_path, capsys):
    data = _data(tmp_path / "d.jsonl", [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(60)])
    cfg = tmp_path / "run.yaml"
    cfg.write_text("seq_len: 32\nbatch_size: 2\nlr: 0.001\n")
    rc = main(["finetune", str(tiny), "--data", str(data), "--output", str(tmp_path / "run"), "--cpu-mem", "256MiB",
               "--config", str(cfg), "--steps", "3", "--grad-accum", "2", "--sample-prompt", "Q1:", "--sample-tokens", "5"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "done: 3 steps" in out and "sample:" in out
    run = tmp_path / "run"
    resolved = json.loads((run / "config.json").read_text())
    assert resolved["seq_len"] == 32 and resolved["grad_accum"] == 2 and resolved["steps"] == 3
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["ssd_read_bytes"] > 0 and r["ssd_write_bytes"] > 0 and r["tokens"] == 2 * 2 * 32 for r in rows)
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_unknown_config_key_is_refused(tiny, tmp_path, capsys):
    data = _data(tmp_path / "d.txt", ["some text " * 50])
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("learning_rate: 0.1\n")
    assert main(["finetune", str(tiny), "--data", str(data), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown option 'learning_rate'" in err and "lr" in err


def test_malformed_data_line_names_file_and_line_before_any_step(tiny, tmp_path, capsys):
    data = _data(tmp_path / "bad.jsonl", [{"text": "fine"}, {"text": "fine too"}, "{not json"])
    assert main(["finetune", str(tiny), "--data", str(data), "--output", str(tmp_path / "run"), "--seq-len", "32"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:3: invalid JSON" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_budget_too_small_says_how_much_and_which_flag(tiny, tmp_path, capsys):
    data = _data(tmp_path / "d.txt", ["some text " * 200])
    assert main(["finetune", str(tiny), "--data", str(data), "--output", str(tmp_path / "run"),
                 "--cpu-mem", "1MiB", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-mem 1.00 MiB cannot hold the working set" in err and "Raise --cpu-mem to" in err


def test_missing_model_directory(tmp_path, capsys):
    assert main(["finetune", str(tmp_path / "nope"), "--data", str(tmp_path / "d.txt")]) == 2
    assert "no such model directory" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_runs_and_loss_goes_down(tmp_path):
    r = tierlm("demo", "--dir", tmp_path / "demo", "--steps", "8")
    assert "demo:" in r.stdout and "sample:" in r.stdout
    summary = json.loads((tmp_path / "demo" / "run" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["last_loss"] < summary["first_loss"]
    # The README's promise: the fine-tune stays under the demo's --cpu-mem beyond the libraries
    # (160 MiB where bf16 is the compute precision, 256 MiB in fp32), a budget below its state.
    from tierlm.demo import SETUPS
    from tierlm.units import parse_bytes
    run_cfg = json.loads((tmp_path / "demo" / "run" / "config.json").read_text())
    budget = parse_bytes(SETUPS[run_cfg["precision"]][1])
    assert parse_bytes(run_cfg["cpu_mem"]) == budget
    assert summary["peak_rss_bytes"] - summary["library_rss_bytes"] <= budget
    assert "training state" in r.stdout and "x the --cpu-mem budget" in r.stdout


def test_timeline_is_valid_and_covers_every_layer(tiny, tmp_path):
    data = _data(tmp_path / "d.txt", ["the timeline shows whether the pipeline is full. " * 40])
    # step 1: its forward reads every weight from the SSD (with the whole state in RAM, whether step
    # 2 reads anything back depends on when its blocks let go of their weights)
    assert main(["finetune", str(tiny), "--data", str(data), "--output", str(tmp_path / "run"), "--seq-len", "32",
                 "--steps", "2", "--timeline-step", "1"]) == 0
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in spans)
    names = {e["name"] for e in spans if e["cat"] == "compute"}
    layers = json.loads((tiny / "config.json").read_text())["num_hidden_layers"]
    assert names == {f"{d} layers.{i}" for d in ("fwd", "bwd") for i in range(layers)} | {
        "fwd head and loss", "bwd head and loss"}
    cats = {e["cat"] for e in spans}
    assert {"compute", "optimizer", "ssd_read", "ssd_write", "wait"} <= cats
    assert (tmp_path / "run" / "timeline.png").stat().st_size > 10_000


HELP_WITHOUT_TORCH = r"""
import contextlib, io, sys
from tierlm.cli import build_parser
parser = build_parser()
for argv in (["--help"], *([verb, "--help"] for verb in sys.argv[1:])):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        parser.parse_args(argv)
print(" ".join(m for m in ("torch", "transformers", "tokenizers", "tqdm") if m in sys.modules) or "none")
"""


def test_help_imports_no_heavy_library():
    """`tierlm --help` and every verb's --help answer without torch or transformers: their import
    is seconds, and a verb pays it only when it runs. (A subprocess: this one has torch loaded.)"""
    verbs = ("init", "finetune", "demo", "generate", "chat", "serve", "plan", "bench")
    r = subprocess.run([sys.executable, "-c", HELP_WITHOUT_TORCH, *verbs], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["none"], f"building the parser and --help imported {r.stdout.strip()}"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_prints_no_library_warnings(tmp_path, arch):
    """Normal use shows tierlm's lines only: the cache passed under the keyword this transformers
    takes (the old one warned on every forward: `past_key_values` is deprecated), GPT-2's loss named
    (transformers warned 'loss_type=None' at the budget's baseline forward)."""
    model = tmp_path / arch
    assert main(["init", str(model), "--arch", arch, "--layers", "2", "--hidden", "64"]) == 0
    r = tierlm("generate", model, "--prompt", "hi", "--max-new-tokens", "4", "--nvme", tmp_path / "store")
    assert "Warning" not in r.stderr and "[transformers]" not in r.stderr, r.stderr
    assert "decode:" in r.stderr  # the report is there: the run got as far as generating


def test_generate_whose_step_fails_says_why_and_exits_1(tmp_path, monkeypatch, capsys):
    """The batcher fails a request whose step raised (the server goes on serving others); `tierlm
    generate` and `chat` then print the reason and exit 1. They printed an empty completion, a
    report of nothing and exited 0 (Zamba's shared attention had no KV cache)."""
    from tierlm.infer.engine import InferenceEngine
    model = tmp_path / "m"
    assert main(["init", str(model), "--arch", "llama", "--layers", "2", "--hidden", "64"]) == 0

    def broken(self, tokens, starts):
        raise RuntimeError("layer 1 broke")
    monkeypatch.setattr(InferenceEngine, "step", broken)
    capsys.readouterr()
    assert main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert "tierlm generate: error: the model's step failed" in err and "RuntimeError: layer 1 broke" in err
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hello\n"))
    assert main(["chat", str(model), "--max-new-tokens", "4"]) == 1
    assert "tierlm chat: error: the model's step failed" in capsys.readouterr().err
