"""The engine's exports: the current weights and master weights of a parameter, read from the
store, and a Hugging Face model directory of them; and the release of what the steps kept in RAM
before an export.

`Engine` takes these methods from `Exports`; they use its store, optimizer, pools and infos.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .. import rss
from ..hf.names import saved_buffers
from ..hf.stacked import file_tensors, file_writes
from ..hf.structure import kept_fp32
from ..hf.safetensors_io import SafetensorsWriter
from ..storage.layout import key

# What a model directory holds beside the weights and config.json that a saved model needs to be
# used as the original was: the tokenizer in any of its formats (tokenizer.json/.model, vocab and
# merges, sentencepiece, added tokens, Mistral's tekken.json), the generation settings (eos ids),
# and the chat template, in tokenizer_config.json or, as transformers 5 saves it, in
# chat_template.jinja, with named extra templates in additional_chat_templates/.
_COPIED_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "spiece",
                    "sentencepiece", "tekken", "generation_config", "chat_template")
_COPIED_DIRS = ("additional_chat_templates",)


class Exports:
    def release_step_memory(self) -> None:
        """After the last step, before an export: hand back what the steps kept for reuse (the
        state cache's copies, the pools' free buffers, the free heap). The export reads one tensor
        at a time and needs none of it: Qwen2.5-0.5B under --cpu-mem 4GiB wrote its final model at
        ~4.0 GiB of RSS before, 1.09 GiB after. Steps may still follow; they read the dropped
        states from disk."""
        self.flush()  # the states kept in RAM since the last commit go to disk first
        self.optimizer.drop_cache()
        for pool in (self.window_pool, self.opt_pool, self.cache_pool):
            if pool is not None:
                pool.trim()
        rss.trim()

    def weights(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The current working weights of one parameter, read from the store (a copy)."""
        out = self._read_param(self._wkind(name), name, self.wdtype(name))
        return out if dtype is None else out.to(dtype)

    def master(self, name: str) -> torch.Tensor:
        """The fp32 master weights of one parameter, read from the store."""
        return self._read_param("master", name, torch.float32)

    def _read_param(self, kind: str, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Every shard of one parameter's `kind`, read into one new tensor (committed first)."""
        self.flush()
        info = self.infos[name]
        out = torch.empty(info.numel, dtype=dtype)
        futs = [self.store.read_into(key(kind, name, k, self.optimizer.committed_slot(name, k)), out[a:b])
                for k, (a, b) in enumerate(info.shards)]
        for f in futs:
            f.result()
        return out.view(info.shape)

    def save_pretrained(self, out_dir, dtype: torch.dtype | None = None, tokenizer_from=None) -> Path:
        """An HF model directory of the current weights, written tensor by tensor."""

        dtype = dtype or self.dtype
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # the family's own tensors (GPT-NeoX's head is `embed_out` in its files; a mixture of experts'
        # stacked experts are one tensor per expert and projection)
        # what the family keeps in fp32 in a model of `dtype` (a router's weights) is saved in fp32, as
        # transformers' save of that model writes it
        wide = kept_fp32(self.model, dtype)
        dt = {n: torch.float32 if n in wide else dtype for n in self.names}
        files = {n: file_tensors(self.model, n, self.infos[n].shape, dt[n]) for n in self.names}
        # (a fused tensor several parameters are cut from is declared once: hf.split_tensors)
        specs = list({f: (f, dt[n], shape) for n in self.names for f, shape in files[n].items()}.values())
        # persistent buffers (DeepSeek-V3's router correction bias) as they are: training moves none
        bufs = {n: b.detach() for n, b in saved_buffers(self.model).items()}
        specs += [(f, b.dtype, b.shape) for n, b in bufs.items() for f in file_tensors(self.model, n, b.shape, b.dtype)]
        with SafetensorsWriter(out, specs) as w:
            for n in self.names:
                for f, t, row in file_writes(self.model, n, self.weights(n, dt[n])):
                    w.write(f, t, row)
            for n, b in bufs.items():
                for f, t, row in file_writes(self.model, n, b):
                    w.write(f, t, row)
        cfg = self.config
        cfg.dtype = dtype
        cfg.save_pretrained(out)
        src = tokenizer_from or getattr(self, "model_dir", None)
        if src and Path(src).resolve() != out.resolve():  # saving over the source: the files are there
            for f in Path(src).iterdir():
                if f.is_file() and f.name.startswith(_COPIED_PREFIXES):
                    shutil.copy2(f, out / f.name)
                elif f.is_dir() and f.name in _COPIED_DIRS:
                    shutil.copytree(f, out / f.name, dirs_exist_ok=True)
        return out
