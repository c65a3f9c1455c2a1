"""`tierlm init`'s options: one typed record that is the flags and the --config file's keys
(tierlm.config). No torch here: `tierlm init --help` answers without it."""
from __future__ import annotations

from dataclasses import dataclass

from .. import validate as V
from ..config import option
from .presets import FAMILIES, NATIVE_PRESETS, PRESETS

# the shape numbers a flag may set over the family's small model or the preset
SHAPE = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions")


@dataclass
class InitConfig:
    """`tierlm init OUT`: a random-initialised Hugging Face model directory."""
    out: str = option(help="directory to create")
    arch: str | None = option(None, metavar="FAMILY", help=f"model family, a small model unless --preset: "
                              f"{', '.join(FAMILIES)}, or any other decoder-only family transformers builds")
    preset: str | None = option(None, choices=sorted(PRESETS) + sorted(NATIVE_PRESETS),
                                help="the shapes of a published model")
    layers: int | None = option(None, help="override layers")
    hidden: int | None = option(None, help="override hidden")
    heads: int | None = option(None, help="override heads")
    kv_heads: int | None = option(None, help="override kv_heads")
    intermediate: int | None = option(None, help="override intermediate")
    vocab: int | None = option(None, help="override vocab")
    max_positions: int | None = option(None, help="override max_positions")
    dtype: str | None = option(None, choices=("bfloat16", "float32", "float16"))
    seed: int = option(0)
    tokenizer_text: list[str] | None = option(None, nargs="*", metavar="FILE",
                                              help="train a BPE tokenizer on these text files "
                                                   "(default: byte-level tokenizer)")
    overwrite: bool = option(False, help="replace a model already in OUT")

    RANGES = V.INIT

    def overrides(self) -> dict:
        """What the flags set over the family's or the preset's config (hf.presets.make_config)."""
        out = {k: getattr(self, k) for k in SHAPE if getattr(self, k) is not None}
        if self.dtype:
            out["dtype"] = self.dtype
        return out
