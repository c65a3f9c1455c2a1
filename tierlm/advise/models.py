"""Which model `tierlm plan` is asked about: a Hugging Face directory, a config.json, an init preset
or a planning shape, read here (the recipe) and sized by tierlm.plan.shapes."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from ..hf.presets import NATIVE_PRESETS, PRESETS, make_config, preset_names
from ..plan.catalog import Catalog
from ..plan.shapes import PLAN_SHAPES, ModelShape, shape_of


def _config_for(model: str):
    """An HF config from a model directory, a config.json path, an init preset or a plan shape."""
    p = Path(model)
    if p.is_dir() or p.name == "config.json":
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file():
            raise ValueError(f"{model}: no config.json there; give a Hugging Face model directory or a preset "
                             f"({', '.join(preset_names() + sorted(PLAN_SHAPES))})")
        return AutoConfig.from_pretrained(cfg_file.parent), str(cfg_file)
    key = model.lower()
    if key in PRESETS or key in NATIVE_PRESETS:
        return make_config(None, key, {}), (PRESETS.get(key) or NATIVE_PRESETS[key]).source
    if key in PLAN_SHAPES:
        arch, source, over = PLAN_SHAPES[key]
        return make_config(arch, None, over), source
    raise ValueError(f"model {model!r}: not a directory with config.json, nor a preset; presets: "
                     f"{', '.join(preset_names() + sorted(PLAN_SHAPES))}")


def model_shape(model: str) -> ModelShape:
    """The shape of `model` (a directory, a config.json, or a preset name), counted on `meta`."""
    config, source = _config_for(model)
    return shape_of(config, Path(model).name if Path(model).exists() else model.lower(), source)


def load_catalog(path: str | Path, catalog: Catalog | None = None) -> Catalog:
    """The built-in catalog with a `--catalog` TOML file's parts added."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--catalog {path}: cannot read it as TOML: {e}") from None
    return (catalog or Catalog()).add_toml(text, str(path))
