"""The training engine's options (EngineConfig), and the run's settings resolved for a model from
them (`tierlm.plan.settings`): what the engine is told, and what it chose from it and why."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ..hf.structure import discover_blocks
from ..plan.durability import parse_commit_every
from ..plan.settings import Measured, ModelFacts, TrainSettings, resolve_train
from ..precision import resolve
from ..storage.commit import committed_shard_elems
from ..storage.packed import PACK_BELOW
from ..units import parse_bytes
from .device import resolve_device
from .optim_types import AdamWConfig
from .state_quant import check_mode


@dataclass
class EngineConfig:
    nvme_dir: str
    cpu_mem: int | str = "4GiB"
    precision: str = "auto"          # bf16: bf16 compute, fp32 master; fp32: everything fp32; auto: measured
    grad_accum: int = 1
    activations: str = "auto"        # auto | keep | swap | swap-host | recompute, or one per layer, comma-separated
    prefetch: int | None = None      # blocks read ahead of the one computing; None: picked (plan.settings)
    shard_elems: int | None = None   # optimizer shard size; None: bench io's pick within the budget where it
                                     # cannot change bits (one micro-batch a step), else the budget's (plan.io.shard_size)
    io_threads: int | None = None    # reads (and writes) in flight; None: `tierlm bench io`'s pick for this file system, else 4
    direct_io: bool | None = None    # None: where the file system allows it
    state_cache: bool = True         # keep optimizer state in RAM between steps where the budget has room
    pack_below: int = PACK_BELOW     # tensors smaller (bytes) live in RAM, one pack file a commit (storage/packed.py); 0: none
    optim_states: str = "fp32"       # fp32 | bf16 | int8: how Adam's m and v are stored (state_quant)
    clip_path: str = "auto"          # auto | speculate | hold: how exact clipping learns its factor (optimizer)
    commit_every: str = "1"          # steps (N), a time (10min) or auto between commits (plan.durability)
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    tokens_per_micro_batch: int = 2048  # for the budget check; the trainer sets batch * seq_len
    micro_batch_size: int = 1        # sequences per micro-batch (to name the longest --seq-len that fits)
    plan_path: str | None = None     # where the activation planner writes plan.json
    device: str = "cpu"              # where layers compute: cpu, cuda[:N], or auto (the GPU if there is one;
                                     # finetune's default: the engine computes where it is told)
    gpu_mem: int | str | None = None  # GPU memory the run may use; None: 90% of what is free at start
    defer_commit: bool = True        # a step's last writes and its manifest land during the next forward
    early_tied: bool = True          # a tied head's rows the batch does not look up update at the start of backward
    next_rows: bool = True           # expect(): the next lookup's embedding rows are kept from the update
    precision_why: str = ""          # why this precision (the recipe's reason, where it resolved `auto` itself)
    loss_chunk: int | None = None    # head + loss tokens a chunk: None = when the logits are large
                                     # (head_loss.chunk_tokens), 0 = never, N = N tokens (tests)

    def __post_init__(self):
        self.cpu_mem = parse_bytes(self.cpu_mem, "cpu_mem")
        if self.gpu_mem is not None:
            self.gpu_mem = parse_bytes(self.gpu_mem, "gpu_mem")
        asked = self.device
        self.device = str(resolve_device(asked))
        # why each was chosen, for the run's settings record (plan.settings)
        self.device_why = f"--device {asked}" + ("" if asked == self.device else f" chose {self.device}")
        self.precision, why = resolve(self.precision, self.device)
        self.precision_why = self.precision_why or why
        pols = self.activations.split(",")
        allowed = ("keep", "swap", "swap-host", "recompute")
        if not (pols == ["auto"] or all(p in allowed for p in pols)):
            raise ValueError(f"--activations must be auto, keep, swap, swap-host or recompute, or one of the "
                             f"last four per decoder layer separated by commas; got {self.activations!r}")
        if self.grad_accum < 1:
            raise ValueError("grad_accum must be >= 1")
        check_mode(self.optim_states)
        parse_commit_every(self.commit_every)  # a bad value names the flag here, before anything is written
        if self.clip_path not in ("auto", "speculate", "hold"):
            raise ValueError(f"--clip-path must be auto, speculate or hold; got {self.clip_path!r}")


def model_facts(model: nn.Module) -> ModelFacts:
    """The largest decoder layer's parameters and the width: what the run's choices need of it."""
    blocks, params = discover_blocks(model)
    layer = max((sum(params[n].numel() for n in b.uses) for b in blocks if b.kind == "layer"), default=0)
    return ModelFacts(layer, model.config.hidden_size)


def train_settings(cfg: EngineConfig, model: nn.Module, resume: bool, measured: Measured | None = None) -> TrainSettings:
    """The run's automatic choices for this model: from what the recipe measured (`tierlm.bench.rates`),
    or from defaults; a resumed run keeps its committed state's shard size."""
    committed = committed_shard_elems(Path(cfg.nvme_dir)) if resume else None
    return resolve_train(cfg, measured or Measured(), model_facts(model), committed)
