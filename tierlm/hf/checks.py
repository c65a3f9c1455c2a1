"""Checks on a model directory before any work starts, each failing with the fix in its message."""
from __future__ import annotations

import json
from pathlib import Path

SUPPORTED = ("llama", "qwen2", "mistral", "gpt2")


class ModelDirError(ValueError):
    pass


def check_model_dir(path) -> dict:
    """Return config.json's contents, or raise ModelDirError naming the problem and the fix."""
    p = Path(path)
    if not p.exists():
        raise ModelDirError(f"{p}: no such model directory; create one with `tierlm init {p} --arch llama` "
                            f"or point at a Hugging Face model directory")
    if not p.is_dir():
        raise ModelDirError(f"{p}: is a file; give the model's directory (the one holding config.json)")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ModelDirError(f"{p}: no config.json; this is not a Hugging Face model directory")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{cfg_path}: unreadable: {e}") from None
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ModelDirError(f"{cfg_path}: model_type {mt!r} is not supported; tierlm supports "
                            f"{', '.join(SUPPORTED)}")
    if not any(p.glob("*.safetensors")):
        hint = " (found PyTorch .bin files: load them with transformers and save_pretrained(dir) to convert)" \
            if any(p.glob("*.bin")) else ""
        raise ModelDirError(f"{p}: no .safetensors weights{hint}")
    return cfg


def load_tokenizer(path):
    from transformers import AutoTokenizer

    p = Path(path)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
        raise ModelDirError(f"{p}: no tokenizer files (tokenizer.json / tokenizer_config.json); copy the "
                            f"tokenizer into the model directory or create one with `tierlm init`")
    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as e:
        raise ModelDirError(f"{p}: cannot load the tokenizer: {e}") from None
