"""2 ranks with global batch B end where 1 process with batch B ends; each holds half the state."""
import json

import pytest
import torch

from tierlm.storage.commit import list_manifests, read_manifest
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig

from .dp_worker import LR
from .util import torchrun

STEPS, ACCUM, BSZ, SEQ, CLIP = 3, 2, 4, 12, 0.5
NAN_STEP = 1  # rank 1's loss is NaN in this step (the one-process reference's too)


def global_batches(n, bsz, seq, vocab=128, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (bsz, seq), generator=g) for _ in range(n)]


def one_process(model_dir, nvme, precision):
    # (ranks decide the clip together after a speculative update: the one process does too, so that
    # the steps' redone flags compare)
    cfg = EngineConfig(nvme_dir=str(nvme), cpu_mem="1GiB", precision=precision, grad_accum=ACCUM,
                       optim=AdamWConfig(lr=LR, weight_decay=0.1, max_grad_norm=CLIP),
                       tokens_per_micro_batch=BSZ * SEQ, clip_path="speculate")
    eng = Engine.from_pretrained(model_dir, cfg)
    data = global_batches(STEPS * ACCUM, BSZ, SEQ)
    results, losses = [], []
    try:
        for s in range(STEPS):
            for x in data[s * ACCUM:(s + 1) * ACCUM]:
                loss = eng.forward(x, labels=x).loss
                if s == NAN_STEP:
                    loss = loss * float("nan")
                eng.backward(loss)
                losses.append(loss.item())
            r = eng.step()
            results.append([r.grad_norm, r.redone, r.finite])
        return {n: eng.master(n) for n in eng.names}, {n: eng.weights(n) for n in eng.names}, results, losses
    finally:
        eng.close()


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def state_bytes(folder):
    """Bytes of fp32 master weights and Adam moments recorded in a folder's newest manifest."""
    recs = read_manifest(list_manifests(folder)[0])["records"]
    return sum(r[2] for k, r in recs.items() if k.split("/")[0].rstrip("01") in ("master", "m", "v"))


@pytest.mark.parametrize("precision", ["fp32"])
def test_two_ranks_equal_one_process_and_halve_the_state(make_model_dir, tmp_path, precision):
    model_dir, _ = make_model_dir("llama")
    r = torchrun(2, "tests/dist/dp_worker.py", model_dir, tmp_path, STEPS, ACCUM, BSZ, SEQ, CLIP, precision)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    ref_master, ref_weights, ref_results, ref_losses = one_process(model_dir, tmp_path / "one", precision)

    masters = {**ranks[0]["masters"], **ranks[1]["masters"]}
    assert not set(ranks[0]["masters"]) & set(ranks[1]["masters"]), "a parameter has two owners"
    assert masters.keys() == ref_master.keys()
    worst = max(rel(masters[n], ref_master[n]) for n in ref_master)
    assert worst < 1e-6, f"relative difference {worst:.2e}"
    for rk in ranks:  # every rank's working weights are the owners' new weights
        assert max(rel(rk["weights"][n], ref_weights[n]) for n in ref_weights) < 1e-6
    # The same clip decisions and (up to summation order) the same norms and losses on both ranks.
    for got in (ranks[0]["results"], ranks[1]["results"]):
        assert [x[1:] for x in got] == [x[1:] for x in ref_results]
        assert got[0][1], "the clipping redo path was not exercised"
        assert not got[NAN_STEP][2], "the non-finite step was not skipped"
        assert all(abs(g[0] - e[0]) <= 1e-5 * e[0] for g, e in zip(got, ref_results) if e[2])
    assert [x[1:] for x in ranks[0]["results"]] == [x[1:] for x in ranks[1]["results"]]
    assert ranks[0]["losses"] == pytest.approx(ref_losses, rel=1e-6, nan_ok=True)

    one = state_bytes(tmp_path / "one")
    shares = [state_bytes(tmp_path / "nvme" / f"rank{i}") / one for i in range(2)]
    assert sum(shares) == pytest.approx(1.0)
    assert all(0.4 <= s <= 0.6 for s in shares), f"optimizer state per rank: {shares}"
    (tmp_path / "shares.json").write_text(json.dumps(shares))
