"""`tierlm finetune --nproc N`: the same command under torchrun, N data-parallel ranks on this machine.

--max-restarts maps to torchrun's own: when any rank dies, torchrun stops the others and, while
restarts are left, starts all N again; each restarted rank resumes (--resume auto) from the newest
step every rank committed.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from ..config import to_dict
from ..dist.group import check_gpus


def launch(cfg) -> int:
    if cfg.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {cfg.nproc}")
    check_gpus(cfg.device, cfg.nproc)  # a GPU for each rank, before torchrun starts any
    from .rundir import created_by_us, undo_refused
    out = Path(cfg.output)
    created = created_by_us(out, cfg.nvme)
    out.mkdir(parents=True, exist_ok=True)
    child = replace(cfg, nproc=None, max_restarts=0)
    path = out / "torchrun-config.json"
    path.write_text(json.dumps({k: v for k, v in to_dict(child).items() if k != "model"}, indent=2))
    args = ["--standalone", f"--nproc-per-node={cfg.nproc}", f"--max-restarts={cfg.max_restarts}",
            "--monitor-interval=0.5", "-m", "tierlm", "finetune", cfg.model, "--config", str(path)]
    print(f"launching: torchrun {' '.join(args)}", file=sys.stderr)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc)))
    try:
        torchrun(args)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        if set(codes.values()) == {2}:
            undo_refused(out, created)  # the ranks leave it to us: they share the directory
            return 2  # bad input, already explained by the ranks
        failures = "; ".join(f"rank {r}: exit code {c}" for r, c in sorted(codes.items()))
        print(f"tierlm finetune: a rank failed ({failures}); the committed state in {cfg.nvme} is intact: "
              f"run again with --resume auto (any --nproc)", file=sys.stderr)
        return 1
    return 0


def check_not_nested(cfg) -> None:
    if cfg.max_restarts > 0:
        raise ValueError("--max-restarts inside torchrun: give it to torchrun (torchrun --max-restarts N), "
                         "or launch with tierlm finetune --nproc N --max-restarts K")


def resume_after_restart(cfg) -> None:
    """A rank that torchrun restarted continues the run rather than starting it over."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        cfg.resume = "auto"
