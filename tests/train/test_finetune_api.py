"""tierlm.finetune(...) from Python: the same options as the CLI, chat data through the template."""
import json

import pytest
import torch

import tierlm
from tests.cpu_spin import after_spinning
from tierlm.config import ConfigError
from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("api") / "qwen"
    init_model(d, make_config("qwen2", None, {"layers": 2, "hidden": 64}))
    return d


def test_finetune_on_chat_messages(model_dir, tmp_path, monkeypatch):
    # the model's loss (computed by transformers on the main thread) also spends a known 40 ms of CPU:
    # a tiny step's own main-thread work can be under the kernel's 10 ms tick on a fast CPU
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", after_spinning(torch.nn.functional.cross_entropy, 0.04))
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}."}]}) for i in range(40)) + "\n")
    summary = tierlm.finetune(model=str(model_dir), data=str(data), output=str(tmp_path / "run"),
                              cpu_mem="256MiB", seq_len=48, batch_size=2, steps=4, lr=3e-3,
                              precision="fp32", max_grad_norm=0)
    assert summary["steps"] == 4
    assert summary["last_loss"] < summary["first_loss"]
    assert summary["lookups_from_update"] == 3  # steps 2-4 read no embedding for their lookup
    assert (tmp_path / "run" / "final" / "config.json").exists()
    assert (tmp_path / "run" / "final" / "tokenizer_config.json").exists()
    # every automatic choice of the run, with its reason, is kept beside its config
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert settings["precision"] == {"value": "fp32", "why": "--precision fp32"}
    assert settings["device"]["value"] == "cpu"
    for k in ("shard_elems", "io_threads", "prefetch", "activations"):
        assert settings[k]["value"] and settings[k]["why"], k
    assert settings["budget_split"]["value"]["budget"] == 256 << 20
    # each step's CPU seconds by component: the layers' thread (with the loss's 40 ms) and the
    # engine's own threads
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["cpu_s"].get("main", 0) >= 0.03 for r in rows), rows
    assert summary["cpu_s_per_step"]["main"] >= 0.03


def test_unknown_option_is_an_error(model_dir):
    with pytest.raises(ConfigError, match="unknown option 'learning_rate'"):
        tierlm.finetune(model=str(model_dir), data="x", learning_rate=1.0)
