"""`tierlm init`, `demo`, `plan` and `bench` read typed configs (tierlm/hf/init_options.py,
tierlm/demo.py, tierlm/advise/options.py): the flags keep their names, defaults and positional
arguments, a `--config FILE` takes the same keys (flag = key), flags override it, and an unknown
key or a number out of range is refused with exit 2 before anything is written."""
import dataclasses
import json
import typing

import pytest

from tierlm.advise.options import BenchConfig, PlanConfig
from tierlm.cli import build_parser, main
from tierlm.config import from_args, to_dict
from tierlm.demo import DemoConfig
from tierlm.hf.init_options import InitConfig
from tierlm.validate import BENCH, DEMO, INIT, PLAN

CONFIGS = {"init": InitConfig, "demo": DemoConfig, "plan": PlanConfig, "bench": BenchConfig}


def _cfg(argv):
    return from_args(CONFIGS[argv[0]], build_parser().parse_args(argv))


def test_the_defaults_are_the_flags_defaults():
    assert to_dict(_cfg(["plan", "gpt2"])) == {
        "model": "gpt2", "task": "finetune", "hardware": "this", "batch": 1, "seq_len": 1024, "tokens": 256,
        "weights": "bf16", "activations": "auto", "precision": "auto", "cpu_mem": None, "gpu_mem": None,
        "state_cache": True, "clip": "on", "compare": None, "chart": None, "json": None, "catalog": None, "nvme": None}
    assert to_dict(_cfg(["bench", "io"])) == {
        "what": "io", "model": None, "data": None, "cpu_mem": "4GiB", "steps": 5, "work": "runs/bench-train",
        "finetune_args": "", "inmemory": "auto", "peers": "auto", "nvme": ".", "size": "2GiB"}
    assert to_dict(_cfg(["demo"])) == {"dir": "runs/demo", "cpu_mem": None, "steps": 30}
    shape = dict.fromkeys(("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions"))
    assert to_dict(_cfg(["init", "OUT"])) == {"out": "OUT", "arch": None, "preset": None, **shape, "dtype": None,
                                              "seed": 0, "tokenizer_text": None, "overwrite": False}


def test_flags_are_parsed_as_before():
    p = _cfg(["plan", "gpt2", "--no-state-cache", "--task", "serve", "--weights", "int4", "--seq-len", "64"])
    assert (p.state_cache, p.task, p.weights, p.seq_len) == (False, "serve", "int4", 64)
    b = _cfg(["bench", "train", "M", "--data", "d.txt", "--finetune-args", "--seq-len 8 --lr 1e-3", "--steps", "3"])
    assert (b.what, b.model, b.data, b.finetune_args, b.steps) == ("train", "M", "d.txt", "--seq-len 8 --lr 1e-3", 3)
    i = _cfg(["init", "OUT", "--arch", "llama", "--kv-heads", "2", "--tokenizer-text", "a.txt", "b.txt", "--overwrite"])
    assert (i.arch, i.kv_heads, i.tokenizer_text, i.overwrite) == ("llama", 2, ["a.txt", "b.txt"], True)
    assert i.overrides() == {"kv_heads": 2}
    assert _cfg(["init", "OUT", "--dtype", "float32", "--hidden", "64"]).overrides() == \
        {"hidden": 64, "dtype": "float32"}
    for bad in (["bench", "disk"], ["plan", "gpt2", "--clip", "sometimes"], ["init", "OUT", "--preset", "gpt5"]):
        with pytest.raises(SystemExit):  # argparse's choices, as before
            build_parser().parse_args(bad)


# (argv with flags, the same options as a --config file's keys, the argv left beside --config)
SAME = [
    (["plan", "gpt2", "--hardware", "lohan", "--batch", "4", "--seq-len", "128", "--no-state-cache",
      "--cpu-mem", "8GiB", "--clip", "redo", "--json", "p.json"],
     {"model": "gpt2", "hardware": "lohan", "batch": 4, "seq_len": 128, "state_cache": False, "cpu_mem": "8GiB",
      "clip": "redo", "json": "p.json"}, ["plan"]),
    (["bench", "train", "M", "--data", "d.txt", "--steps", "3", "--finetune-args", "--seq-len 8",
      "--inmemory", "never", "--size", "1GiB"],
     {"what": "train", "model": "M", "data": "d.txt", "steps": 3, "finetune_args": "--seq-len 8",
      "inmemory": "never", "size": "1GiB"}, ["bench"]),
    (["init", "OUT", "--arch", "llama", "--layers", "2", "--hidden", "64", "--seed", "7",
      "--tokenizer-text", "a.txt", "b.txt", "--overwrite"],
     {"out": "OUT", "arch": "llama", "layers": 2, "hidden": 64, "seed": 7, "tokenizer_text": ["a.txt", "b.txt"],
      "overwrite": True}, ["init"]),
    (["demo", "--dir", "d", "--cpu-mem", "300MiB", "--steps", "4"], {"dir": "d", "cpu_mem": "300MiB", "steps": 4},
     ["demo"]),
]


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
@pytest.mark.parametrize("flags, keys, rest", SAME, ids=[s[0][0] for s in SAME])
def test_a_config_file_key_is_its_flag(tmp_path, flags, keys, rest, suffix):
    f = tmp_path / f"opts{suffix}"
    if suffix == ".toml":
        f.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    else:  # JSON is YAML too
        f.write_text(json.dumps(keys))
    from_file = _cfg([*rest, "--config", str(f)])
    assert from_file == _cfg(flags)
    assert {k: to_dict(from_file)[k] for k in keys} == keys  # the logged value is the key's


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "plan.yaml"
    f.write_text("model: gpt2\nbatch: 8\nstate_cache: false\n")
    p = _cfg(["plan", "--config", str(f), "--batch", "2", "--state-cache"])
    assert (p.model, p.batch, p.state_cache) == ("gpt2", 2, True)
    f.write_text("what: io\nsize: 1GiB\n")
    assert (_cfg(["bench", "compute", "--config", str(f)]).what, _cfg(["bench", "--config", str(f)]).size) == \
        ("compute", "1GiB")


@pytest.mark.parametrize("argv", [["plan", "gpt2", "--hardware", "lohan"], ["bench", "io"], ["init", "OUT"],
                                  ["demo"]], ids=lambda a: a[0])
def test_an_unknown_key_is_refused_and_nothing_written(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "opts.yaml"
    f.write_text("learning_rate: 1\n")
    assert main([*argv, "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"tierlm {argv[0]}: error: unknown option 'learning_rate' in --config {f}" in err, err
    assert list(tmp_path.iterdir()) == [f], "a refused command wrote something"


@pytest.mark.parametrize("argv, file, words", [
    (["plan", "gpt2"], "batch: 0\n", "batch in --config {f} must be an integer >= 1; got 0"),
    (["bench", "io"], "size: 0GiB\n", "size in --config {f} must be a size > 0 bytes"),
    (["init", "OUT"], "layers: -1\n", "layers in --config {f} must be an integer >= 1; got -1"),
    (["demo"], "steps: 0\n", "steps in --config {f} must be an integer >= 1; got 0"),
], ids=lambda x: x[0] if isinstance(x, list) else None)
def test_a_file_value_out_of_range_is_named_by_its_key(tmp_path, monkeypatch, capsys, argv, file, words):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "opts.yaml"
    f.write_text(file)
    assert main([*argv, "--config", str(f)]) == 2
    assert words.format(f=f) in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [f]


@pytest.mark.parametrize("cls, ranges", [(InitConfig, INIT), (DemoConfig, DEMO), (PlanConfig, PLAN),
                                         (BenchConfig, BENCH)])
def test_every_number_has_a_range(cls, ranges):
    hints = typing.get_type_hints(cls)
    numeric = {f.name for f in dataclasses.fields(cls)
               if {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}}
    sizes = {f.name for f in dataclasses.fields(cls) if f.name in ("cpu_mem", "gpu_mem", "size")}
    assert numeric | sizes == set(ranges) and cls.RANGES is ranges


def test_a_missing_positional_is_refused_with_exit_2(capsys):
    assert main(["plan", "--hardware", "lohan"]) == 2
    assert "model is required" in capsys.readouterr().err
    assert main(["bench"]) == 2
    assert "what is required" in capsys.readouterr().err


def test_init_from_a_config_file_makes_the_model(tmp_path):
    f = tmp_path / "init.toml"
    f.write_text('arch = "llama"\nlayers = 2\nhidden = 64\nheads = 4\nkv_heads = 2\nvocab = 300\n')
    assert main(["init", str(tmp_path / "m"), "--config", str(f)]) == 0
    made = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (made["num_hidden_layers"], made["hidden_size"], made["num_key_value_heads"]) == (2, 64, 2)


def test_the_demo_takes_a_python_config_checked_like_the_flags(tmp_path):
    from tierlm.config import ConfigError
    from tierlm.demo import run_demo
    with pytest.raises(ConfigError, match=r"^steps must be an integer >= 1; got 0$"):
        run_demo(DemoConfig(dir=str(tmp_path / "demo"), steps=0))
    assert not (tmp_path / "demo").exists()
