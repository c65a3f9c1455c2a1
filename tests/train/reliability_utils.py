"""Shared set-up for the reliability tests: a tiny model, data, and comparisons of whole runs."""
import json
from pathlib import Path

from tierlm.storage.commit import list_manifests, read_manifest
from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config
from tierlm.storage.records import record_bytes

# Clipping that triggers (the redo path), accumulation (the accumulator files), checkpoints.
RUN_ARGS = ["--seq-len", "24", "--batch-size", "2", "--grad-accum", "2", "--steps", "6", "--lr", "3e-3",
            "--max-grad-norm", "0.5", "--precision", "fp32", "--save-every", "2", "--weight-decay", "0.01",
            "--schedule", "cosine", "--warmup-steps", "1", "--cpu-mem", "256MiB",
            # a commit every step: the tests name the manifest before the last (a test may override it)
            "--commit-every", "1"]


def make_inputs(root: Path) -> tuple[Path, Path]:
    model = root / "model"
    if not model.exists():
        init_model(model, make_config("llama", None, {"layers": 2, "hidden": 64}))
    data = root / "data.txt"
    data.write_text("\n".join(f"Record {i}: out-of-core training keeps state on the SSD." for i in range(300)))
    return model, data


def state_of(run: Path) -> dict:
    """Everything a run ends with: the committed state's bytes, the saved model, the loss history."""
    nvme = run / "nvme"
    manifest = read_manifest(list_manifests(nvme)[0])
    # a record's bytes (a direct write leaves its file's last block whole; small ones share a pack)
    # keyed without the slot: which of the two slots holds the state depends on when commits
    # happened (--commit-every), not on the state
    files = {unslotted(k): record_bytes(nvme, k, rec) for k, rec in manifest["records"].items()}
    final = {p.name: p.read_bytes() for p in sorted((run / "final").glob("*.safetensors"))}
    losses = [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    return {"step": manifest["step"], "optim": manifest["optim"]["steps"], "files": files, "final": final,
            "losses": losses}


def unslotted(key: str) -> str:
    """A store key without its slot digit ('m1/x.0' -> 'm/x.0')."""
    kind, _, rest = key.partition("/")
    return kind.rstrip("01") + "/" + rest if rest else key


def assert_same_run(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert a["optim"] == b["optim"]
    assert a["files"].keys() == b["files"].keys()
    bad = [k for k in a["files"] if a["files"][k] != b["files"][k]]
    assert not bad, f"state files differ: {bad[:5]}"
    assert a["final"] == b["final"]
    assert a["losses"] == b["losses"]
