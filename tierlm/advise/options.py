"""The options of `tierlm plan` and `tierlm bench`, one typed config per verb.

Each config is the verb's flags, the keys of its `--config FILE` and (plan) the values its --json
logs (tierlm/config.py builds the parser from the fields; flags override the file). RANGES are
checked as the config is built, before anything is measured or written. This module imports no
torch: building the command line and `--help` answer at once (tests/test_cli.py checks).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import validate as V
from ..config import option


@dataclass
class PlanConfig:
    """`tierlm plan MODEL`: which hardware, which placement, how fast, at what cost."""
    model: str = option(help="a Hugging Face model directory, a config.json, or a preset (see `tierlm init --help`)")
    task: str = option("finetune", choices=("finetune", "serve"), help="what to plan: fine-tuning or serving")
    hardware: str = option("this", help="'this' (measured), a system name, or parts joined by '+', "
                                        "e.g. rtx4090+256GiB+p5510*12")
    batch: int = option(1, help="sequences per step (finetune) or concurrent requests (serve)")
    seq_len: int = option(1024, help="training sequence length, or prompt length when serving")
    tokens: int = option(256, help="serve: tokens generated per request")
    weights: str = option("bf16", choices=("bf16", "int8", "int4"),
                          help="serve: the decoder layers' weight format, as `tierlm generate --weights` holds them")
    activations: str = option("auto", choices=("auto", "keep", "swap", "recompute"),
                              help="saved activations: auto (the fastest split), keep in RAM, swap to NVMe, recompute")
    precision: str = option("auto", choices=("auto", "bf16", "fp32"),
                            help="auto: bf16 on catalog hardware; on 'this', what `tierlm finetune` would measure "
                                 "and pick")
    cpu_mem: str | None = option(None, metavar="SIZE",
                                 help="RAM the run may use (default: the machine's less a reserve)")
    gpu_mem: str | None = option(None, metavar="SIZE",
                                 help="serve: GPU memory the run may use (default: the card's)")
    state_cache: bool = option(True, help="keep optimizer state in RAM where it has room; --no-state-cache "
                                          "streams all of it through the SSD (today's engine)")
    clip: str = option("on", choices=("on", "off", "redo"),
                       help="gradient clipping: on (gradients saved for an exact redo), off, redo (every step clips)")
    compare: str | None = option(None, metavar="HW1,HW2,...|all", help="rank these options and chart them")
    chart: str | None = option(None, metavar="PNG", help="where --compare draws throughput vs cost")
    json: str | None = option(None, metavar="FILE", help="also write the plan as JSON (with this config)")
    catalog: str | None = option(None, metavar="TOML",
                                 help="your own parts: [gpu.NAME], [cpu.NAME], [drive.NAME], [system]")
    nvme: str | None = option(None, metavar="DIR", help="with --hardware this: the NVMe directory to measure")

    RANGES = V.PLAN


@dataclass
class BenchConfig:
    """`tierlm bench io|compute|train`: measure this machine, or a training step in memory vs out-of-core."""
    what: str = option(choices=("io", "compute", "train"),
                       help="io: NVMe read/write and host memory; compute: matmul, a decoder layer, AdamW and the "
                            "engine's fixed costs per step and layer (on --nvme); train: MODEL in memory and "
                            "out-of-core side by side")
    model: str | None = option(None, help="train: the model directory")
    data: str | None = option(None, help="train: the training data")
    cpu_mem: str = option("4GiB", help="train: the out-of-core run's budget")
    steps: int = option(5, help="train: steps of each run (the first two are warm-up: they create the state files)")
    work: str = option("runs/bench-train", help="train: where both runs write")
    finetune_args: str = option("", help="train: more finetune options for both runs, e.g. "
                                         "'--seq-len 1024 --batch-size 4'")
    inmemory: str = option("auto", choices=("auto", "always", "never"),
                           help="train: run the in-memory reference where its estimate fits the RAM (auto), anyway "
                                "(always: it may be killed for memory), or not (never: compare with the I/O bound "
                                "only)")
    peers: str = option("auto", choices=("auto", "none"),
                        help="train: also run DeepSpeed ZeRO-3 offloaded to NVMe on the same model, data and batch "
                             "where it is installed (auto), or not (none)")
    nvme: str = option(".", metavar="DIR", help="directory on the drive to measure (io)")
    size: str = option("2GiB", help="bytes to write and read back (io)")

    RANGES = V.BENCH
