"""hf.checks: a model directory tierlm cannot run is refused with the reason and the way out."""
import json

import pytest

from tierlm.hf.checks import ModelDirError, check_model_dir, family_problem


@pytest.mark.parametrize("cfg,words", [
    ({}, "no model_type"),
    # a family newer than the installed transformers: the way out is a tierlm that installs a newer one
    ({"model_type": "llama9000"}, "unknown to the installed transformers"),
    ({"model_type": "llama9000", "auto_map": {"AutoModelForCausalLM": "m.M"}}, "remote code"),
    ({"model_type": "t5"}, "encoder-decoder"),
    ({"model_type": "bert"}, "encoder (bidirectional)"),
    ({"model_type": "llama4", "text_config": {"model_type": "llama4_text"}}, "'llama4_text'"),
])
def test_a_family_tierlm_cannot_run_is_refused_by_name(cfg, words):
    why = family_problem(cfg)
    assert why is not None and words in why, why
    if cfg.get("model_type") == "llama9000" and "auto_map" not in cfg:
        assert "upgrade tierlm" in why


def test_a_decoder_family_transformers_builds_is_accepted():
    assert family_problem({"model_type": "llama"}) is None
    assert family_problem({"model_type": "kolibri1_1"}) is None


def test_the_directory_is_checked_before_its_family(tmp_path):
    with pytest.raises(ModelDirError, match="no such model directory"):
        check_model_dir(tmp_path / "missing")
    with pytest.raises(ModelDirError, match="no config.json"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ModelDirError, match="encoder-decoder"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelDirError, match="no .safetensors weights"):
        check_model_dir(tmp_path)
