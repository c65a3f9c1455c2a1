"""`tierlm generate`, `chat` and `serve` read typed configs (tierlm/serve/options.py): the flags keep
their names and defaults, a `--config FILE` takes the same keys, flags override it, every number has
its range, and `generate --json` logs the config it ran."""
import dataclasses
import typing

import pytest

from tierlm.cli import build_parser, main
from tierlm.config import ConfigError, from_args, to_dict
from tierlm.serve.options import ChatConfig, GenerateConfig, ServeConfig
from tierlm.validate import CHAT, GENERATE, SERVE

ENGINE_DEFAULTS = {"cpu_mem": "4GiB", "weights": "bf16", "dtype": None, "nvme": None, "max_seq_len": None,
                   "step_tokens": 256, "prefetch": 2, "expert_cache": "lfu", "resident_layers": None, "tp": 1,
                   "threads": None, "device": "auto", "gpu_mem": None}
SAMPLING_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "stop": []}


def _cfg(cls, argv):
    return from_args(cls, build_parser().parse_args(argv))


def test_the_defaults_are_the_flags_defaults():
    g = to_dict(_cfg(GenerateConfig, ["generate", "M", "--prompt", "hi"]))
    assert g == {"model": "M", "prompt": "hi", **ENGINE_DEFAULTS, **SAMPLING_DEFAULTS, "max_new_tokens": 128,
                 "chat": False, "batch": 1, "ignore_eos": False, "json": None}
    c = to_dict(_cfg(ChatConfig, ["chat", "M"]))
    assert c == {"model": "M", **ENGINE_DEFAULTS, **SAMPLING_DEFAULTS, "max_new_tokens": 256, "system": None}
    s = to_dict(_cfg(ServeConfig, ["serve", "M"]))
    assert s == {"model": "M", **ENGINE_DEFAULTS, "max_batch": 8, "host": "127.0.0.1", "port": 8000,
                 "served_model_name": None}


def test_flags_are_parsed_as_before():
    g = _cfg(GenerateConfig, ["generate", "M", "--prompt", "hi", "--chat", "--ignore-eos", "--stop", "a",
                              "--stop", "\n\n", "--weights", "int8", "--temperature", "0.7", "--top-k", "5",
                              "--batch", "3", "--json", "r.json", "--tp", "2"])
    assert (g.chat, g.ignore_eos, g.stop, g.weights, g.temperature, g.top_k, g.batch, g.json, g.tp) == \
        (True, True, ["a", "\n\n"], "int8", 0.7, 5, 3, "r.json", 2)
    s = _cfg(ServeConfig, ["serve", "M", "--max-batch", "4", "--host", "0.0.0.0", "--port", "9000",
                           "--served-model-name", "m"])
    assert (s.max_batch, s.host, s.port, s.served_model_name) == (4, "0.0.0.0", 9000, "m")
    with pytest.raises(SystemExit):  # argparse's choices, as before
        build_parser().parse_args(["chat", "M", "--dtype", "fp16"])


def test_a_config_file_has_the_same_keys_and_flags_override_it(tmp_path):
    f = tmp_path / "gen.yaml"
    f.write_text("model: M\nprompt: from the file\nmax_new_tokens: 7\nstop: [x, y]\ntemperature: 0.5\n")
    g = _cfg(GenerateConfig, ["generate", "--config", str(f), "--temperature", "0.9"])
    assert (g.model, g.prompt, g.max_new_tokens, g.stop, g.temperature) == ("M", "from the file", 7, ["x", "y"], 0.9)
    f.write_text("model: M\nprompt: p\nstop: one\n")
    assert _cfg(GenerateConfig, ["generate", "--config", str(f)]).stop == ["one"]
    f.write_text("model: M\nprompt: p\nmax_batch: 3\n")  # serve's key, not generate's
    with pytest.raises(ConfigError, match="unknown option 'max_batch'"):
        _cfg(GenerateConfig, ["generate", "--config", str(f)])


def test_a_missing_prompt_or_a_bad_file_value_is_refused_with_exit_2(tmp_path, capsys):
    assert main(["generate", "M"]) == 2
    assert "prompt is required" in capsys.readouterr().err
    f = tmp_path / "serve.toml"
    f.write_text('model = "M"\nport = 0\n')
    assert main(["serve", "--config", str(f)]) == 2
    assert f"port in --config {f} must be an integer in [1, 65535]; got 0" in capsys.readouterr().err


@pytest.mark.parametrize("cls, ranges", [(GenerateConfig, GENERATE), (ChatConfig, CHAT), (ServeConfig, SERVE)])
def test_every_number_has_a_range(cls, ranges):
    hints = typing.get_type_hints(cls)
    numeric = {f.name for f in dataclasses.fields(cls) if {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}}
    assert numeric | {"cpu_mem", "gpu_mem"} == set(ranges) and cls.RANGES is ranges


def test_help_names_each_default_once():
    sub = next(a for a in build_parser()._actions if a.dest == "verb").choices["generate"]
    helps = {a.dest: a.help for a in sub._actions}
    assert helps["max_new_tokens"].count("default: 128") == 1 and helps["cpu_mem"].count("default: 4GiB") == 1
    assert "repeatable" in helps["stop"]


def test_generate_logs_the_config_it_ran(tiny, tmp_path, monkeypatch, capsys):
    """flag = file key = logged value: the --json report holds the config, under the flags' names."""
    import json

    from tierlm.bench import rooflines
    monkeypatch.setattr(rooflines, "machine_rates", lambda *a, **k: {"mem_gbps": 10.0})
    f = tmp_path / "gen.toml"
    f.write_text('prompt = "hello"\nmax_new_tokens = 3\n')
    rep = tmp_path / "report.json"
    assert main(["generate", str(tiny), "--config", str(f), "--weights", "fp32", "--cpu-mem", "1GiB",
                 "--nvme", str(tmp_path / "store"), "--ignore-eos", "--json", str(rep)]) == 0
    got = json.loads(rep.read_text())
    assert got["config"] == to_dict(_cfg(GenerateConfig, ["generate", str(tiny), "--config", str(f), "--weights",
                                                          "fp32", "--cpu-mem", "1GiB", "--nvme", str(tmp_path / "store"),
                                                          "--ignore-eos", "--json", str(rep)]))
    assert got["config"]["max_new_tokens"] == 3 and got["completion_tokens"] == [3]
    assert got["rates"] == {"mem_gbps": 10.0} and "decode:" in capsys.readouterr().err
