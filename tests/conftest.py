import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """The session's own cache of measured rates ($TIERLM_CACHE_DIR), so what a test sees does not
    depend on what `tierlm bench` left in the user's cache: the first run that plans activations
    probes the drive and keeps it there for the runs after it, as a user's runs do. Compiled
    kernels stay shared with the user's cache (a compile takes seconds and changes no result)."""
    if "TIERLM_CACHE_DIR" in os.environ:
        return
    user = Path.home() / ".cache" / "tierlm"
    (user / "kernels").mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="tierlm-test-cache-"))
    (root / "kernels").symlink_to(user / "kernels", target_is_directory=True)
    os.environ["TIERLM_CACHE_DIR"] = config._tierlm_cache = str(root)


def pytest_unconfigure(config):
    root = getattr(config, "_tierlm_cache", None)
    if root:
        os.environ.pop("TIERLM_CACHE_DIR", None)
        shutil.rmtree(root, ignore_errors=True)

TINY = {
    "llama": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64),
    "qwen2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
}


def tiny_config(arch: str, **over):
    from transformers import AutoConfig
    kw = dict(TINY[arch])
    kw.update(over)
    return AutoConfig.for_model(arch, **kw)


def tiny_model(arch: str, seed: int = 0, **over):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **over)).float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer llama made by `tierlm init` (byte tokenizer), one per test module that asks."""
    from tierlm.cli import main
    d = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["init", str(d), "--arch", "llama", "--layers", "2", "--hidden", "64"]) == 0
    return d


@pytest.fixture
def make_model_dir(tmp_path):
    """A tiny random HF model directory (fp32 safetensors) and the in-memory model it holds."""
    def make(arch="llama", seed=0, name=None, **over):
        model = tiny_model(arch, seed, **over)
        d = tmp_path / (name or f"{arch}-model")
        model.save_pretrained(d)
        return d, model
    return make
