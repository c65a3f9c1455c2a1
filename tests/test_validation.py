"""Every numeric option is checked before anything is written (issue 40): exit 2, the flag and its
range named, and no run directory, output directory or `.lock` left behind. A refusal that comes
after the run directory exists (bad data, a missing model, a budget too small) removes what the run
created, and never what the user had there."""
import argparse
import json
import math

import pytest

from tierlm.cli import build_parser, main
from tierlm.config import ConfigError, build
from tierlm.validate import BENCH, CHAT, DEMO, FINETUNE, GENERATE, INIT, PLAN, SERVE, Num, Size


def _no_trace(*paths):
    for p in paths:
        assert not p.exists(), f"{p} was left behind"


# ---- finetune: flags, --config files, the Python API ---------------------------------------------

FINETUNE_BAD = [  # (flag, value, words the message must hold)
    ("--lr", "nan", "--lr must be a finite number > 0; got nan"),
    ("--lr", "inf", "--lr must be a finite number > 0; got inf"),
    ("--lr", "-1", "--lr must be a finite number > 0; got -1"),
    ("--lr", "0", "--lr must be a finite number > 0; got 0"),
    ("--beta1", "1.5", "--beta1 must be a finite number in [0, 1); got 1.5"),
    ("--beta1", "-0.1", "--beta1 must be a finite number in [0, 1)"),
    ("--beta2", "1", "--beta2 must be a finite number in [0, 1); got 1"),
    ("--beta2", "nan", "--beta2 must be a finite number in [0, 1); got nan"),
    ("--eps", "0", "--eps must be a finite number > 0"),
    ("--eps", "-inf", "--eps must be a finite number > 0; got -inf"),
    ("--weight-decay", "-0.01", "--weight-decay must be a finite number >= 0"),
    ("--weight-decay", "nan", "--weight-decay must be a finite number >= 0; got nan"),
    ("--max-grad-norm", "-1", "--max-grad-norm must be a finite number >= 0 (0 disables clipping); got -1"),
    ("--max-grad-norm", "inf", "--max-grad-norm must be a finite number >= 0"),
    ("--steps", "0", "--steps must be an integer >= 1; got 0"),
    ("--steps", "-1", "--steps must be an integer >= 1; got -1"),
    ("--epochs", "0", "--epochs must be a finite number > 0"),
    ("--epochs", "nan", "--epochs must be a finite number > 0; got nan"),
    ("--seq-len", "0", "--seq-len must be an integer >= 1"),
    ("--batch-size", "0", "--batch-size must be an integer >= 1"),
    ("--grad-accum", "-2", "--grad-accum must be an integer >= 1"),
    ("--warmup-steps", "-1", "--warmup-steps must be an integer >= 0"),
    ("--save-every", "-1", "--save-every must be an integer >= 0 (0 disables)"),
    ("--timeline-step", "-1", "--timeline-step must be an integer >= 0 (0 disables)"),
    ("--max-restarts", "-1", "--max-restarts must be an integer >= 0"),
    ("--max-bad-steps", "0", "--max-bad-steps must be an integer >= 1"),
    ("--nproc", "0", "--nproc must be an integer >= 1"),
    ("--prefetch", "-1", "--prefetch must be an integer >= 0"),
    ("--seed", str(2**64), "--seed must be an integer in [-2**63, 2**64 - 1]"),
    ("--sample-tokens", "0", "--sample-tokens must be an integer >= 1"),
    ("--sample-temperature", "-1", "--sample-temperature must be a finite number in [0, 100]"),
    ("--dist-timeout", "0", "--dist-timeout must be a finite number > 0"),
    ("--cpu-mem", "0", "--cpu-mem must be a size > 0 bytes"),
    ("--cpu-mem", "0GiB", "--cpu-mem must be a size > 0 bytes"),
    ("--gpu-mem", "0MiB", "--gpu-mem must be a size > 0 bytes"),
]


@pytest.mark.parametrize("flag, value, words", FINETUNE_BAD, ids=[f"{f}={v}" for f, v, _ in FINETUNE_BAD])
def test_finetune_refuses_a_number_out_of_range_and_writes_nothing(tmp_path, capsys, flag, value, words):
    out, nvme = tmp_path / "run", tmp_path / "nvme"
    rc = main(["finetune", str(tmp_path / "model"), "--data", str(tmp_path / "d.txt"), "--output", str(out),
               "--nvme", str(nvme), f"{flag}={value}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"tierlm finetune: error: {words}" in err, err
    _no_trace(out, nvme)


def test_every_finetune_number_has_a_range():
    """A numeric option added without a range would take NaN again: this fails until it has one."""
    import dataclasses
    import typing

    from tierlm.train.finetune import FinetuneConfig
    hints = typing.get_type_hints(FinetuneConfig)
    numeric = {f.name for f in dataclasses.fields(FinetuneConfig)
               if {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}}
    assert numeric - set(FINETUNE) == set()
    assert {"cpu_mem", "gpu_mem"} <= set(FINETUNE) and FinetuneConfig.RANGES is FINETUNE


def test_config_file_value_is_named_by_its_key_and_file(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lr: .nan\nbeta1: 0.9\n")
    out = tmp_path / "run"
    assert main(["finetune", str(tmp_path / "m"), "--data", "d", "--output", str(out), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"lr in --config {cfg} must be a finite number > 0; got nan" in err, err
    _no_trace(out)
    # a flag overrides the file's value, and then the flag is what is named
    cfg.write_text("beta2: 0.5\n")
    assert main(["finetune", str(tmp_path / "m"), "--data", "d", "--output", str(out), "--config", str(cfg),
                 "--beta2", "2"]) == 2
    assert "--beta2 must be a finite number in [0, 1); got 2" in capsys.readouterr().err


def test_config_file_steps_zero_is_refused(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text("steps = 0\n")
    assert main(["finetune", "m", "--data", "d", "--output", str(tmp_path / "run"), "--config", str(cfg)]) == 2
    assert f"steps in --config {cfg} must be an integer >= 1; got 0" in capsys.readouterr().err
    _no_trace(tmp_path / "run")


def test_python_api_refuses_before_writing(tmp_path):
    from tierlm.train.finetune import FinetuneConfig, finetune
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^lr must be a finite number > 0; got nan$"):
        finetune(model="m", data="d", output=str(out), lr=math.nan)
    # a config made directly skips build(); finetune() checks it all the same
    cfg = FinetuneConfig(model="m", data="d", output=str(out), beta1=1.5)
    with pytest.raises(ConfigError, match=r"^beta1 must be a finite number in \[0, 1\); got 1.5$"):
        finetune(cfg)
    _no_trace(out)


def test_boundaries_are_accepted():
    from tierlm.train.finetune import FinetuneConfig
    cfg = build(FinetuneConfig, {"model": "m", "data": "d", "lr": 1e-5, "beta1": 0.0, "beta2": 0.999,
                                 "max_grad_norm": 0.0, "weight_decay": 0.0, "steps": 1, "warmup_steps": 0,
                                 "save_every": 0, "timeline_step": 0, "seed": -1, "sample_temperature": 100.0})
    assert cfg.steps == 1 and cfg.max_grad_norm == 0.0


@pytest.mark.parametrize("rng, good, bad", [
    (Num(gt=0), [1e-300, 5.0], [0.0, -1.0, math.nan, math.inf, True, "1"]),
    (Num(ge=0, lt=1), [0.0, 0.999999], [1.0, -1e-9, math.nan]),
    (Num(int, ge=1), [1, 10**12], [0, -1, 1.0, 2.5]),
    (Size(), ["1", "4GiB", 1], ["0", "0GiB", 0]),
])
def test_ranges(rng, good, bad):
    for v in good:
        assert rng.check(v, "--x") == v
    for v in bad:
        with pytest.raises(ValueError, match="^--x must be"):
            rng.check(v, "--x")


# ---- the other verbs' flags ---------------------------------------------------------------------

VERB_BAD = [  # (argv after the verb, words)
    (["generate", "M", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1; got 0"),
    (["generate", "M", "--prompt", "hi", "--temperature", "nan"], "--temperature must be a finite number in [0, 100]"),
    (["generate", "M", "--prompt", "hi", "--temperature", "-1"], "--temperature must be a finite number in [0, 100]"),
    (["generate", "M", "--prompt", "hi", "--top-p", "0"], "--top-p must be a finite number in (0, 1]; got 0"),
    (["generate", "M", "--prompt", "hi", "--top-p", "1.5"], "--top-p must be a finite number in (0, 1]"),
    (["generate", "M", "--prompt", "hi", "--top-k", "-1"], "--top-k must be an integer >= 0 (0 turns it off)"),
    (["generate", "M", "--prompt", "hi", "--batch", "0"], "--batch must be an integer >= 1"),
    (["generate", "M", "--prompt", "hi", "--cpu-mem", "0GiB"], "--cpu-mem must be a size > 0 bytes"),
    (["generate", "M", "--prompt", "hi", "--step-tokens", "0"], "--step-tokens must be an integer >= 1"),
    (["generate", "M", "--prompt", "hi", "--prefetch", "-1"], "--prefetch must be an integer >= 0"),
    (["generate", "M", "--prompt", "hi", "--tp", "0"], "--tp must be an integer >= 1"),
    (["generate", "M", "--prompt", "hi", "--threads", "0"], "--threads must be an integer >= 1"),
    (["generate", "M", "--prompt", "hi", "--max-seq-len", "0"], "--max-seq-len must be an integer >= 1"),
    (["generate", "M", "--prompt", "hi", "--resident-layers", "-1"], "--resident-layers must be an integer >= 0"),
    (["chat", "M", "--max-new-tokens", "-5"], "--max-new-tokens must be an integer >= 1; got -5"),
    (["serve", "M", "--max-batch", "0"], "--max-batch must be an integer >= 1"),
    (["serve", "M", "--port", "0"], "--port must be an integer in [1, 65535]; got 0"),
    (["serve", "M", "--port", "70000"], "--port must be an integer in [1, 65535]"),
    (["plan", "llama-2-13b", "--batch", "0"], "--batch must be an integer >= 1"),
    (["plan", "llama-2-13b", "--seq-len", "-1"], "--seq-len must be an integer >= 1"),
    (["plan", "llama-2-13b", "--task", "serve", "--tokens", "0"], "--tokens must be an integer >= 1"),
    (["plan", "llama-2-13b", "--cpu-mem", "0GiB"], "--cpu-mem must be a size > 0 bytes"),
    (["bench", "train", "M", "--data", "d", "--steps", "0"], "--steps must be an integer >= 1"),
    (["bench", "io", "--size", "0"], "--size must be a size > 0 bytes"),
    (["demo", "--steps", "0"], "--steps must be an integer >= 1"),
    (["demo", "--cpu-mem", "0MiB"], "--cpu-mem must be a size > 0 bytes"),
    (["init", "OUT", "--arch", "llama", "--layers", "0"], "--layers must be an integer >= 1"),
    (["init", "OUT", "--arch", "llama", "--hidden", "-64"], "--hidden must be an integer >= 1"),
]


@pytest.mark.parametrize("argv, words", VERB_BAD, ids=[" ".join(a[:1] + a[-2:]) for a, _ in VERB_BAD])
def test_verbs_refuse_a_number_out_of_range(tmp_path, monkeypatch, capsys, argv, words):
    monkeypatch.chdir(tmp_path)  # demo's runs/demo, init's OUT, bench's runs/bench-train: all relative
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"tierlm {argv[0]}: error: {words}" in err, err
    assert list(tmp_path.iterdir()) == [], "a refused command wrote something"


def _subparsers(parser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a.choices
    raise AssertionError("no verbs")


def test_every_numeric_flag_of_every_verb_has_a_range():
    """A verb that gains an int or float flag fails here until tierlm/validate.py gives it a range."""
    for verb, sub in _subparsers(build_parser()).items():
        configs = {"finetune": FINETUNE, "generate": GENERATE, "chat": CHAT, "serve": SERVE,  # their RANGES
                   "init": INIT, "demo": DEMO, "plan": PLAN, "bench": BENCH}
        known = set(configs[verb])
        numeric = {a.dest for a in sub._actions if a.type in (int, float)}
        assert numeric - known == set(), f"tierlm {verb}: no range for {numeric - known}"
        sizes = {a.dest for a in sub._actions if a.dest in ("cpu_mem", "gpu_mem", "size")}
        assert sizes - known == set(), f"tierlm {verb}: no range for {sizes - known}"


# ---- a refusal after the run directory exists removes what the run made --------------------------

def test_missing_model_leaves_no_run_directory(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "run"   # parents made for the run go too
    assert main(["finetune", str(tmp_path / "nope"), "--data", "d.txt", "--output", str(out)]) == 2
    assert "no such model directory" in capsys.readouterr().err
    _no_trace(tmp_path / "a")


def test_bad_data_leaves_no_run_directory_nor_nvme_directory(tiny, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    out, nvme = tmp_path / "run", tmp_path / "ssd" / "state"
    assert main(["finetune", str(tiny), "--data", str(data), "--output", str(out), "--nvme", str(nvme),
                 "--seq-len", "32"]) == 2
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err
    _no_trace(out, tmp_path / "ssd")


def test_budget_refusal_leaves_no_run_directory(tiny, tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("some text " * 200)
    out = tmp_path / "run"
    assert main(["finetune", str(tiny), "--data", str(data), "--output", str(out), "--cpu-mem", "1MiB",
                 "--seq-len", "64"]) == 2
    assert "Raise --cpu-mem to" in capsys.readouterr().err
    _no_trace(out)


def test_refusal_in_the_users_directory_keeps_its_content_and_drops_the_lock(tiny, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["finetune", str(tiny), "--data", str(tmp_path / "missing.jsonl"), "--output", str(out),
                 "--seq-len", "32"]) == 2
    capsys.readouterr()
    assert (out / "notes.txt").read_text() == "keep me"
    _no_trace(out / ".lock", out / "nvme")  # the run's own nvme folder under it went


def test_lock_file_goes_with_the_lock_and_the_directory_can_be_locked_again(tmp_path):
    from tierlm.train.rundir import RunLock
    a = RunLock(tmp_path)
    with pytest.raises(ValueError, match="is in use by a running fine-tune"):
        RunLock(tmp_path)
    a.release()
    _no_trace(tmp_path / ".lock")
    b = RunLock(tmp_path)
    assert (tmp_path / ".lock").exists()
    b.release()
    b.release()  # twice is harmless


def test_supervised_refusal_leaves_no_run_directory(tmp_path, capsys):
    """--max-restarts: the supervisor made the directory for its child; a refused child (exit 2) is no
    crash to restart, and the supervisor's own files go with the directory."""
    out = tmp_path / "run"
    assert main(["finetune", str(tmp_path / "nope"), "--data", "d.txt", "--output", str(out),
                 "--max-restarts", "2", "--precision", "fp32", "--device", "cpu"]) == 2
    assert "restart" not in capsys.readouterr().err
    _no_trace(out)


def test_bench_train_checks_the_finetune_args_before_its_work_directory(tmp_path, capsys):
    work = tmp_path / "work"
    assert main(["bench", "train", str(tmp_path / "nope"), "--data", "d.txt", "--work", str(work),
                 "--finetune-args", "--lr nan --seq-len 64"]) == 2
    assert "tierlm bench: error: --lr must be a finite number > 0; got nan" in capsys.readouterr().err
    _no_trace(work)


def test_help_says_each_range():
    verbs = _subparsers(build_parser())
    assert "(default: 1; an integer >= 1)" in " ".join(verbs["plan"].format_help().split())
    assert "(default: 1; an integer >= 1)" in " ".join(verbs["generate"].format_help().split())  # a config's
    assert "a finite number in [0, 1)" in " ".join(verbs["finetune"].format_help().split())


def test_a_yaml_boolean_is_no_number(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lr: yes\n")
    assert main(["finetune", "m", "--data", "d", "--output", str(tmp_path / "run"), "--config", str(cfg)]) == 2
    assert f"lr in --config {cfg}: expected float, got True" in capsys.readouterr().err
