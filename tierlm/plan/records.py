"""What `tierlm plan` is asked (a Task) and what it answers (a Plan), and the RAM a task may use."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .catalog import GiB, Hardware

# Host RAM the planner leaves to the OS, the libraries and the allocator (assumption).
HOST_RESERVE_BYTES = 8 * GiB
HOST_RESERVE_FRACTION = 0.05


@dataclass
class Task:
    kind: str = "finetune"           # finetune | serve
    batch: int = 1                   # sequences per micro-batch / concurrent requests
    seq_len: int = 1024              # training sequence, or prompt length when serving
    new_tokens: int = 256            # serve: tokens generated per request
    activations: str = "auto"        # auto | keep | swap (to NVMe) | recompute
    state_cache: bool = True         # keep optimizer state resident in RAM where it fits
    cpu_mem: int | None = None       # RAM the run may use (default: the machine's, less a reserve)
    precision: str = "auto"          # auto: what `tierlm finetune` would pick on the hardware (its ISA flags)
    clip: str = "on"                 # on: gradients saved for an exact clip redo; off; redo: every step clips
    weights: str = "bf16"            # serve: the decoder layers' weight format (bf16 | int8 | int4)
    gpu_mem: int | None = None       # serve: GPU memory the run may use (default: the card's)

    def validate(self) -> "Task":
        if self.kind not in ("finetune", "serve"):
            raise ValueError(f"--task {self.kind!r}: use finetune or serve")
        for name in ("batch", "seq_len", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.activations not in ("auto", "keep", "swap", "recompute"):
            raise ValueError(f"--activations {self.activations!r}: use auto, keep, swap or recompute")
        if self.clip not in ("on", "off", "redo"):
            raise ValueError(f"--clip {self.clip!r}: use on, off or redo")
        if self.weights not in ("bf16", "int8", "int4"):
            raise ValueError(f"--weights {self.weights!r}: use bf16, int8 or int4")
        if self.weights != "bf16" and self.kind != "serve":
            raise ValueError(f"--weights {self.weights} is for --task serve (fine-tuning keeps bf16/fp32 weights)")
        return self


@dataclass
class Plan:
    model: dict
    hardware: dict
    task: dict
    fits: bool
    problems: list[str]                       # what does not fit, by how much, and what to change
    placement: dict = field(default_factory=dict)   # tier -> {what: bytes}
    activations: dict = field(default_factory=dict)  # layers kept / in RAM / on NVMe / recomputed
    resources_s: dict = field(default_factory=dict)  # per resource, seconds per step
    devices_s: dict = field(default_factory=dict)    # per physical device (what overlaps)
    binding: str | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None               # model FLOPs per second achieved (6PT + attention)
    traffic_bytes: dict = field(default_factory=dict)
    cost: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    assumptions: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # this machine: the run's own choices (plan.settings), and why

    def to_json(self) -> dict:
        return asdict(self)


def usable_ram(hw: Hardware, task: Task) -> int:
    """The RAM the run may use: --cpu-mem where given, else the machine's less a reserve (a
    measured machine's RAM is what it has, so only the fraction is kept back)."""
    if task.cpu_mem is not None:
        return task.cpu_mem
    if hw.measured is not None:
        return int(hw.ram_bytes * (1 - HOST_RESERVE_FRACTION))
    return int(hw.ram_bytes - HOST_RESERVE_BYTES - HOST_RESERVE_FRACTION * hw.ram_bytes)
