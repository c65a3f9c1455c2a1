"""`tierlm finetune`'s options: one typed record that is the flags, the --config file's keys and the
logged config.json (tierlm.config). No torch here: `tierlm finetune --help` answers without it."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import option
from ..validate import FINETUNE
from .schedule import SCHEDULES


@dataclass
class FinetuneConfig:
    model: str = option(help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    data: str = option(help="training data: a .jsonl file (text | prompt+completion | messages), a text file, or a folder")
    output: str | None = option(None, help="run directory (config, metrics.jsonl, final model); default runs/finetune-<time>")
    nvme: str | None = option(None, help="directory on the SSD for weights and optimizer states; default <output>/nvme")
    cpu_mem: str = option("4GiB", help="RAM the run may use beyond the torch import", metavar="SIZE")
    device: str = option("auto", help="where layers compute: cpu, cuda (cuda:N), or auto: the GPU where PyTorch "
                         "sees one; the optimizer runs on the CPU and the state lives on --nvme either way")
    gpu_mem: str | None = option(None, help="GPU memory the run may use (default: 90%% of what is free at start)",
                                 metavar="SIZE")
    precision: str = option("auto", help="bf16: bf16 compute + fp32 master weights; fp32: all fp32; auto: bf16 where "
                            "this CPU has bf16 matrix instructions (AVX512_BF16, AMX-BF16, Arm BF16; read from its "
                            "ISA flags, never timed; a resumed run keeps its own)", choices=("auto", "bf16", "fp32"))
    seq_len: int = option(512, help="tokens per packed training row")
    batch_size: int = option(1, help="rows per micro-batch")
    grad_accum: int = option(1, help="micro-batches per optimizer step")
    steps: int | None = option(None, help="optimizer steps (default: --epochs over the data); a resumed run "
                               "that has done them all has nothing to do and saves final/ again")
    epochs: float = option(1.0, help="passes over the data when --steps is not given")
    lr: float = option(1e-5, help="peak learning rate")
    schedule: str = option("constant", help="learning-rate schedule after warm-up", choices=SCHEDULES)
    warmup_steps: int = option(0, help="linear warm-up steps from 0")
    weight_decay: float = option(0.0, help="AdamW decoupled weight decay")
    beta1: float = option(0.9, help="AdamW beta1")
    beta2: float = option(0.999, help="AdamW beta2")
    eps: float = option(1e-8, help="AdamW epsilon")
    max_grad_norm: float | None = option(1.0, help="clip the global gradient norm to this (exact); 0 disables")
    commit_every: str = option("auto", help="how often the state is made durable: a number of steps (1: every "
                               "step), a time (10min), or auto (the shortest interval whose commit costs at most 5%% of "
                               "the training time, measured on the first steps and printed). Between commits the "
                               "optimizer state the budget keeps in RAM is not written; a crash resumes from the last "
                               "commit and replays the steps since to the same bits")
    clip_path: str = option("auto", help="how exact clipping learns its factor: hold (gradients saved, the update "
                            "after backward once the norm is known), speculate (the update beside backward, redone "
                            "when the step clips), auto (hold when the last step clipped, and on the first); the "
                            "same bits either way", choices=("auto", "speculate", "hold"))
    optim_impl: str = option("fused", help="torch AdamW kernel the update uses", choices=("fused", "foreach", "single"))
    optim_states: str = option("fp32", help="how AdamW's m and v are stored on the SSD: fp32, bf16, or int8 (block-wise "
                               "8-bit quantisation): 12, 8 or ~6 bytes a parameter of optimizer state each way per "
                               "step, at a small cost in quality (docs/benchmarks.md)", choices=("fp32", "bf16", "int8"))
    activations: str = option("auto", help="per decoder layer: keep saved activations in RAM, swap them to the NVMe "
                              "store (swap) or a host buffer pool (swap-host), or recompute them in backward; auto: "
                              "the planner chooses from a profiled step (plan.json); or one policy per layer, "
                              "comma-separated")
    prefetch: int | None = option(None, help="layers read ahead of the one computing (default: picked from "
                                  "`tierlm bench io`, `tierlm bench compute` and the model, and printed)")
    seed: int = option(0, help="seed for data order and dropout")
    save_dtype: str | None = option(None, help="dtype of the saved model (default: the compute dtype)", choices=("bf16", "fp32"))
    sample_prompt: str | None = option(None, help="generate from this prompt with the fine-tuned model at the end")
    sample_tokens: int = option(40, help="tokens to generate for --sample-prompt")
    sample_temperature: float = option(0.0, help="sampling temperature for --sample-prompt (0: greedy)")
    direct_io: bool | None = option(None, help="force direct I/O on or off (default: where the file system allows)")
    timeline_step: int | None = option(2, help="record this step's timeline (timeline.json for Perfetto, "
                                       "timeline.png); 0 disables")
    resume: str = option("no", help="auto: continue from the newest intact committed state in --nvme "
                         "(a fresh start when there is none); no: a new run", choices=("no", "auto"))
    overwrite: bool = option(False, help="start a new run even where --nvme holds a committed state (deletes it)")
    save_every: int | None = option(None, help="keep a named checkpoint of the committed state every N steps "
                                    "(hard links: no bytes copied)")
    max_restarts: int = option(0, help="after a crash or kill, restart and resume, up to N times")
    max_bad_steps: int = option(5, help="stop after this many consecutive steps with non-finite loss or "
                                "gradients (each such step is skipped, the state left as it was)")
    allow_config_change: bool = option(False, help="resume although options that change results differ from the run's")
    nproc: int | None = option(None, help="data parallelism: run N ranks on this machine under torchrun "
                               "(--batch-size is the global batch, split across them)")
    dist_timeout: float = option(300.0, help="seconds a rank waits for the others before the job fails "
                                 "(a dead or stuck rank)")
    grad_bucket: str = option("25MiB", help="data parallelism on GPUs: fp32 gradient bytes per NCCL reduce, "
                              "each sent as backward fills it (the CPU path reduces each parameter alone)",
                              metavar="SIZE")

    # every numeric option's allowed range (tierlm/validate.py), checked when the config is built
    RANGES = FINETUNE
