"""`--max-restarts N`: run the fine-tune in a child process and restart it after a crash.

Each restart resumes from the newest intact committed state (--resume auto), so a crash costs at
most the step in flight. Bad input (exit code 2) is not retried: it would fail the same way. Each
restart is logged with its cause to the run directory's restarts.jsonl and to stderr.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..config import to_dict
from ..units import count


def _cause(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


def supervise(cfg) -> int:
    from .rundir import created_by_us, undo_refused
    out = Path(cfg.output)
    created = created_by_us(out, cfg.nvme)
    out.mkdir(parents=True, exist_ok=True)
    child_cfg = out / "supervised-config.json"
    log = out / "restarts.jsonl"
    restarts = 0
    resume = cfg.resume
    while True:
        c = replace(cfg, max_restarts=0, resume=resume)
        child_cfg.write_text(json.dumps({k: v for k, v in to_dict(c).items() if k != "model"}, indent=2))
        cmd = [sys.executable, "-m", "tierlm", "finetune", cfg.model, "--config", str(child_cfg)]
        started = time.time()
        proc = subprocess.Popen(cmd)
        (out / "child.pid").write_text(f"{proc.pid}\n")
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            proc.wait()
            raise
        if rc == 2:  # refused (bad input, said by the child): what this run created goes, as without us
            undo_refused(out, created)
        if rc in (0, 2):
            if restarts:
                print(f"supervisor: finished after {restarts} restart(s); see {log}", file=sys.stderr)
            return rc
        cause = _cause(rc)
        with open(log, "a") as f:
            f.write(json.dumps({"time": time.time(), "attempt": restarts + 1, "cause": cause,
                                "ran_s": time.time() - started}) + "\n")
        if restarts >= cfg.max_restarts:
            print(f"supervisor: giving up: the run failed {count(restarts + 1, 'time')} (last: {cause}); "
                  f"--max-restarts {cfg.max_restarts} reached. The committed state in {cfg.nvme} is "
                  f"intact: fix the cause, then run again with --resume auto. Causes: {log}", file=sys.stderr)
            return 1
        restarts += 1
        resume = "auto"
        print(f"supervisor: the run {cause}; restart {restarts} of {cfg.max_restarts}, resuming", file=sys.stderr)
