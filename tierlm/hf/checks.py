"""Checks on a model directory before any work starts, each failing with the fix in its message."""
from __future__ import annotations

import json
from pathlib import Path

# The families tests/test_families.py runs through every verb (fine-tune exact against
# torch.optim.AdamW, generate equal to transformers, serve, reload). Any other decoder-only family
# transformers builds runs on the same generic path; `family_problem` refuses what cannot.
TESTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo",
          "olmo2", "gpt_neox", "gpt2", "falcon", "starcoder2", "granite", "cohere", "cohere2", "glm", "glm4",
          "smollm3", "ernie4_5", "exaone4", "olmo3", "apertus", "arcee", "stablelm", "nemotron", "vaultgemma",
          "hunyuan_v1_dense", "ministral", "seed_oss", "helium", "internlm3", "bitnet", "gpt_bigcode", "nanochat",
          "apertus1p5_text", "jais2", "hyperclovax", "iquestcoder", "cwm", "opt", "modernbert-decoder",
          "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "glm4_moe", "hunyuan_v1_moe",
          "minimax_m2", "jetmoe", "flex_olmo", "cohere2_moe", "exaone_moe", "granitemoe", "granitemoeshared",
          "deepseek_v2", "dots1", "dbrx", "hy_v3", "ernie4_5_moe", "laguna", "afmoe", "gemma4_text",
          "deepseek_v32", "glm_moe_dsa", "sarvam_moe", "mimo_v2_flash", "xglm", "longcat_flash",
          "zaya", "kolibri1_1", "deepseek_v4", "minimax", "gemma3n_text", "bloom", "mpt", "doge",
          "gpt_neox_japanese", "gpt_neo", "gptj", "codegen", "persimmon", "qwen4_exp_text", "cohere_compass_text",
          "dots3_note_text")


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
    problem = family_problem(cfg)
    if problem:
        raise ModelDirError(f"{cfg_path}: {problem}")
    if not any(p.glob("*.safetensors")):
        hint = " (found PyTorch .bin files: load them with transformers and save_pretrained(dir) to convert)" \
            if any(p.glob("*.bin")) else ""
        raise ModelDirError(f"{p}: no .safetensors weights{hint}")
    return cfg


def family_problem(cfg: dict) -> str | None:
    """Why tierlm cannot run the model config.json describes (with the way out where there is one),
    or None: every decoder-only causal LM the installed transformers builds runs on the generic path,
    with the family's own modules."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as auto

    mt = cfg.get("model_type")
    if not mt:
        return "no model_type; this config.json is not a transformers model's"
    if mt not in CONFIG_MAPPING:
        if cfg.get("auto_map"):
            return (f"model_type {mt!r} is remote code (auto_map), which tierlm does not run: it runs the "
                    "modeling code transformers ships. Use a checkpoint of a transformers family, or upgrade "
                    "transformers if this family has been added to it")
        import transformers
        return (f"model_type {mt!r} is unknown to the installed transformers {transformers.__version__}; "
                "a newer family needs a newer transformers: upgrade tierlm, which installs the newest "
                "transformers its tests have passed on")
    if cfg.get("is_encoder_decoder") or mt in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return (f"model_type {mt!r} is an encoder-decoder model; tierlm fine-tunes and serves decoder-only "
                "causal language models")
    if mt in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return (f"model_type {mt!r} is an encoder (bidirectional) model; tierlm fine-tunes and serves "
                "decoder-only causal language models")
    class_fields = getattr(CONFIG_MAPPING[mt], "__dataclass_fields__", {})
    if "backbone_hidden_size" in cfg or "backbone_hidden_size" in class_fields:
        # (Gemma 4's assistants: each layer attends over the target's keys and values, its input the
        # target's embeddings and hidden states; transformers' own forward refuses input ids alone)
        return (f"model_type {mt!r} is an assistant (draft) model: it runs on the hidden states and keys of the "
                "target model it was trained with (backbone_hidden_size), not on its own; tierlm runs the "
                "target model (e.g. gemma4_text), which generates without it")
    text = cfg.get("text_config")
    if text is None and mt in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        default_text = getattr(CONFIG_MAPPING[mt](), "text_config", None)
        text = {"model_type": getattr(default_text, "model_type", None)} if default_text is not None else None
    if isinstance(text, dict) or mt in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        way = ""
        if isinstance(text, dict) and text.get("model_type"):
            way = (f"; use its text model on its own: a directory whose config.json is this text_config "
                   f"(model_type {text['model_type']!r}) with the language model's weights, e.g. saved by "
                   f"transformers from the loaded model's language_model")
        return f"model_type {mt!r} is a multimodal wrapper, which tierlm does not run{way}"
    # whole models' configs inside it and no width of its own (BLT's patcher, encoder, global and
    # decoder; MusicGen's text and audio encoders and decoder), unlike a family that keeps parts of
    # its own config apart (DBRX's attn_config) or beside its own decoder (Moshi's audio encoder)
    nested = [k for k, v in cfg.items() if isinstance(v, dict) and v.get("model_type") in CONFIG_MAPPING]
    if nested and not any(k in cfg for k in ("hidden_size", "n_embd", "d_model")):
        return (f"model_type {mt!r} is built of several models ({', '.join(nested)}), which tierlm does not run: "
                "it runs one decoder-only causal language model")
    if mt not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model_type {mt!r} has no causal language model class in transformers (AutoModelForCausalLM)"
    return None


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
