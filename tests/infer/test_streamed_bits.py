"""Streamed and resident layers give the same bits: for the same rows, a layer computes with the
same arithmetic wherever its weights live (window buffer or resident), on every path our kernels
take (AVX-512 BF16 rows, AVX2, the portable loops, x exact or light) and on either side of the
bf16 predicate (fp32 conversion for prefill, our kernel for a few rows, F.linear).

A test of the budget once saw greedy tokens differ at index 2 between a streamed and a resident
run on an AMX machine and pass the second time: the choice of kernel came from a speed probe in each
process, so two processes could compute a prefill differently. The choice now comes from the ISA
flags (tierlm.precision.cpu_bf16_isa); this checks the placements against each other bit for bit."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tierlm.infer import fused, gemv, lean, native
from tierlm.infer.engine import InferConfig, InferenceEngine
from ..memory import held_now

# a prompt of 20 tokens: past UPCAST_MIN_ROWS, so a prefill where bf16 is slow converts to fp32
PROMPTS = [[(7 * i + 3) % 120 + 1 for i in range(20)], [100, 7, 42]]
PLACEMENTS = (None, 1, 0)  # all resident (one fused call a step), one layer resident, all streamed


def _model(d):
    from tests.conftest import tiny_model
    model = tiny_model("llama", intermediate_size=128, initializer_range=0.3)
    model.to(torch.bfloat16).save_pretrained(d)


def _steps(d, store, resident, weights, rows):
    """`rows` sequences: their prefill, then 6 decode steps of all together on fixed tokens; the
    logits of every step, prefill included."""
    # the placements are named by resident_layers, not by the budget
    cfg = InferConfig(cpu_mem="4GiB", nvme_dir=str(store), max_batch=rows, max_seq_len=40, weights=weights,
                      resident_layers=resident, prefetch=1)
    eng = InferenceEngine(d, cfg, library_rss=held_now())
    try:
        if resident is not None:
            assert eng.stream is not None and eng.placement.resident == resident
        prompts = PROMPTS[:rows]
        out = [eng.step(prompts, [0] * rows)]
        starts = [len(p) for p in prompts]
        for t in range(6):
            out.append(eng.step([[(13 * t + 1 + 16 * r) % 120 + 1] for r in range(rows)], starts))
            starts = [s + 1 for s in starts]
    finally:
        eng.close()
    return out


def compare(d, tmp, weights="bf16") -> dict:
    """Each placement's logits against all-resident's, rows 1 and 2: the first difference, or none."""
    found = {}
    for rows in (1, 2):
        ref = _steps(d, tmp / f"store-{weights}-{rows}-all", None, weights, rows)
        for resident in PLACEMENTS[1:]:
            got = _steps(d, tmp / f"store-{weights}-{rows}-{resident}", resident, weights, rows)
            bad = [i for i, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b)]
            found[f"rows={rows} resident={resident}"] = (
                None if not bad else f"step {bad[0]}: max |diff| {(got[bad[0]] - ref[bad[0]]).abs().max().item():.3g}")
    return found


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bits") / "llama-bf16"
    _model(d)
    return d


def _set_slow(monkeypatch, slow):
    for mod in (gemv, lean, fused):
        monkeypatch.setattr(mod, "bf16_matmul_is_slow", lambda: slow)


@pytest.mark.parametrize("slow", [False, True], ids=["bf16-matmul", "no-bf16-matmul"])
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_streamed_and_resident_give_the_same_bits(model_dir, tmp_path, monkeypatch, slow, weights):
    """Both sides of the bf16 predicate in this process: our kernel or F.linear for a few rows, the
    fp32 conversion or bf16 for the 20-token prefill; streamed layers take what resident ones take."""
    _set_slow(monkeypatch, slow)
    assert compare(model_dir, tmp_path, weights) == {k: None for k in compare_keys()}


def compare_keys():
    return [f"rows={r} resident={p}" for r in (1, 2) for p in PLACEMENTS[1:]]


# our kernels' paths (TIERLM_NATIVE_ISA, read once a process; tierlm/infer/native.py), x rounded
# exactly on the AVX-512 one-row loops, and no kernels of ours at all
ISA_PATHS = {**{isa: {"TIERLM_NATIVE_ISA": isa} for isa in getattr(native, "ISAS", ())},
             "exact-x": {"TIERLM_NATIVE_EXACT_X": "1"}, "torch-only": {"TIERLM_NATIVE": "0"}}


@pytest.mark.slow
@pytest.mark.skipif(not native.available(), reason=f"no kernels: {native.why_unavailable()}")
@pytest.mark.parametrize("path", sorted(ISA_PATHS))
def test_every_kernel_path_gives_streamed_the_resident_bits(model_dir, tmp_path, path):
    """The other ISA paths of our kernels, each in its own process (the switches are read once)."""
    code = ("import json, pathlib, sys\nfrom tests.infer.test_streamed_bits import compare\n"
            "d, t = map(pathlib.Path, sys.argv[1:3])\n"
            "print(json.dumps({w: compare(d, t, w) for w in ('bf16', 'int8')}))")
    r = subprocess.run([sys.executable, "-c", code, str(model_dir), str(tmp_path)], capture_output=True, text=True,
                       timeout=900, env={**os.environ, **ISA_PATHS[path]},
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if "this CPU has no" in r.stderr:
        pytest.skip(f"{path}: this CPU does not have it")
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found == {w: {k: None for k in compare_keys()} for w in ("bf16", "int8")}
