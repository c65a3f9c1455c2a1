"""Storage faults, numerical faults and bad input: detected, named, and nothing good is lost."""
import json
import os
import shutil
import subprocess

import pytest

import tierlm.faults as faults
from tierlm.cli import main
from tierlm.storage.commit import list_manifests, read_manifest
from tierlm.storage.records import record_file
from tierlm.train.rundir import RunLock

from .reliability_utils import RUN_ARGS, assert_same_run, make_inputs, state_of


def run(model, data, out, *extra):
    return main(["finetune", str(model), "--data", str(data), "--output", str(out), *RUN_ARGS, *extra])


def with_steps(args, n):
    a = list(args)
    a[a.index("--steps") + 1] = str(n)
    return a


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("rel")
    model, data = make_inputs(root)
    assert run(model, data, root / "ref") == 0
    return root, model, data, state_of(root / "ref")


def current_record(out, packed: bool, kind="master") -> str:
    """A current record's key: one with a file of its own, or one in the step's pack of small tensors."""
    recs = read_manifest(list_manifests(out / "nvme")[0])["records"]
    return sorted(k for k, r in recs.items() if k.startswith(kind) and (len(r) > 4) == packed)[-1]


def file_of(manifest, key):
    return manifest.parent / record_file(key, read_manifest(manifest)["records"][key])


@pytest.mark.parametrize("packed", [False, True], ids=["own-file", "pack"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "delete-manifest", "mix-generations"])
def test_damaged_state_is_named_and_resume_uses_the_previous_good_one(ref, damage, packed, capsys):
    if damage == "delete-manifest" and packed:
        pytest.skip("no file is damaged")
    root, model, data, reference = ref
    out = root / f"damage-{damage}-{packed}"
    shutil.rmtree(out, ignore_errors=True)
    args = with_steps(RUN_ARGS, 4)
    assert main(["finetune", str(model), "--data", str(data), "--output", str(out), *args]) == 0
    # The same run, never damaged, is what the damaged one must end up as.
    clean = root / f"clean-{damage}-{packed}"
    shutil.rmtree(clean, ignore_errors=True)
    shutil.copytree(out, clean)
    k = current_record(out, packed)
    f = file_of(list_manifests(out / "nvme")[0], k)
    if damage == "truncate":
        os.truncate(f, f.stat().st_size // 2)
    elif damage == "flip":
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 3] ^= 0x08
        f.write_bytes(bytes(raw))
    elif damage == "delete-manifest":
        list_manifests(out / "nvme")[0].unlink()
    else:  # an older generation's file under the current name (from the step-2 checkpoint)
        shutil.copy2(file_of(list_manifests(out / "nvme" / "checkpoints" / "step-00000002")[0], k), f)
    capsys.readouterr()
    args = with_steps(RUN_ARGS, 4) + ["--resume", "auto"]
    assert main(["finetune", str(model), "--data", str(data), "--output", str(out), *args]) == 0
    err = capsys.readouterr().err
    if damage != "delete-manifest":
        assert f"passed over manifest-00000004.json: {f}" in err
        assert ("truncated" if damage == "truncate" else "checksum") in err
    assert "resumed after step 3 (the last committed" in err and "continuing with step 4 of 4" in err
    assert main(["finetune", str(model), "--data", str(data), "--output", str(clean), *args]) == 0
    assert_same_run(state_of(clean), state_of(out))


def test_full_disk_during_a_step_is_clear_and_the_state_survives(ref, monkeypatch, capsys):
    root, model, data, reference = ref
    out = root / "diskfull"
    monkeypatch.setattr(faults, "_PLAN", faults._parse("store.write:60:enospc"))
    monkeypatch.setattr(faults, "_counts", {})
    assert run(model, data, out) == 1
    err = capsys.readouterr().err
    assert "write failed: the disk is full" in err and str(out / "nvme") in err
    monkeypatch.setattr(faults, "_PLAN", {})
    assert run(model, data, out, "--resume", "auto") == 0
    assert_same_run(reference, state_of(out))


def test_full_real_file_system_is_refused_before_writing(ref, tmp_path, capsys):
    root, model, data, _ = ref
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here")
    try:
        assert run(model, data, tmp_path / "run", "--nvme", str(mnt / "nvme")) == 2
        err = capsys.readouterr().err
        assert "the state needs" in err and "free" in err and "--nvme" in err
    finally:
        subprocess.run(["umount", str(mnt)])


def test_read_only_nvme_is_refused(ref, tmp_path, capsys):
    root, model, data, _ = ref
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only file system here")
    try:
        assert run(model, data, tmp_path / "run", "--nvme", str(mnt)) == 2
        assert "cannot write there" in capsys.readouterr().err
    finally:
        subprocess.run(["umount", str(mnt)])


def test_nan_step_is_skipped_and_leaves_the_state_as_it_was(ref, monkeypatch, capsys):
    root, model, data, _ = ref
    args4 = with_steps(RUN_ARGS, 4) + ["--schedule", "constant"]  # the lr must not depend on --steps
    clean = root / "nan-clean"
    assert main(["finetune", str(model), "--data", str(data), "--output", str(clean), *args4, "--steps", "3"]) == 0
    out = root / "nan"
    # Micro-batch 7 is the first of step 4 (two per step): its loss becomes NaN.
    monkeypatch.setattr(faults, "_PLAN", faults._parse("loss:7:nan"))
    monkeypatch.setattr(faults, "_counts", {})
    assert main(["finetune", str(model), "--data", str(data), "--output", str(out), *args4]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [False, False, False, True]
    a, b = read_manifest(list_manifests(out / "nvme")[0]), read_manifest(list_manifests(clean / "nvme")[0])
    # step 4 changed nothing (the same tensors; its pack of small ones is step 4's own file)
    assert a["optim"] == b["optim"] and {k: r[:4] for k, r in a["records"].items()} == \
        {k: r[:4] for k, r in b["records"].items()}


def test_repeated_nan_steps_stop_the_run(ref, monkeypatch, capsys):
    root, model, data, _ = ref
    import tierlm.train.finetune as ft
    monkeypatch.setattr(ft, "fault", lambda point: "nan" if point == "loss" else None)
    assert run(model, data, root / "allnan", "--max-bad-steps", "2") == 1
    err = capsys.readouterr().err
    assert "2 consecutive steps had non-finite loss or gradients" in err and "--resume auto" in err


def test_second_run_in_the_same_directory_is_refused(ref, tmp_path, capsys):
    root, model, data, _ = ref
    out = tmp_path / "busy"
    out.mkdir()
    lock = RunLock(out)
    try:
        assert run(model, data, out) == 2
        assert "is in use by a running fine-tune" in capsys.readouterr().err
    finally:
        lock.release()


def test_new_run_over_committed_state_is_refused_and_keeps_it(ref, capsys):
    root, model, data, _ = ref
    out = root / "ref"
    before = state_of(out)
    assert run(model, data, out) == 2
    assert "holds the committed state of a run at step 6" in capsys.readouterr().err
    assert_same_run(before, state_of(out))


def test_resume_with_changed_options_names_the_difference(ref, capsys):
    root, model, data, _ = ref
    out = root / "ref"
    before = state_of(out)
    assert main(["finetune", str(model), "--data", str(data), "--output", str(out), *RUN_ARGS,
                 "--resume", "auto", "--lr", "0.1"]) == 2
    assert "lr: 0.003 in the run, 0.1 now" in capsys.readouterr().err
    assert_same_run(before, state_of(out))


@pytest.mark.parametrize("case", ["unsupported-arch", "no-tokenizer", "seq-len"])
def test_bad_model_input(ref, tmp_path, case, capsys):
    root, model, data, _ = ref
    m = tmp_path / "m"
    shutil.copytree(model, m)
    extra = []
    if case == "unsupported-arch":
        cfg = json.loads((m / "config.json").read_text())
        cfg["model_type"] = "bert"
        (m / "config.json").write_text(json.dumps(cfg))
        want = "model_type 'bert' is an encoder (bidirectional) model"
    elif case == "no-tokenizer":
        for f in m.glob("tokenizer*"):
            f.unlink()
        want = "no tokenizer files"
    else:
        extra = ["--seq-len", "100000"]
        want = "--seq-len 100000 is beyond the"
    assert main(["finetune", str(m), "--data", str(data), "--output", str(tmp_path / "run"), *RUN_ARGS, *extra]) == 2
    assert want in capsys.readouterr().err
