"""--commit-every: steps between commits write no state the budget keeps in RAM, the state they
reach equals torch's, and only a commit moves the manifest."""
import pytest
import torch

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig
from tierlm.plan.durability import auto_interval, commit_cost_s, due, parse_commit_every
from tierlm.storage.commit import list_manifests, read_manifest
from tierlm.train.schedule import lr_factor

from .test_exactness import assert_same, batches, run_engine, run_reference

STEPS = 5


@pytest.mark.parametrize("precision,clip,state_cache", [
    ("fp32", 0.5, True), ("fp32", None, False), ("bf16", 1.0, True), ("bf16", 100.0, False), ("fp32", 0.5, False)],
    ids=["fp32-clip-cached", "fp32-noclip-disk", "bf16-clip-cached", "bf16-clip-never-disk", "fp32-clip-disk"])
def test_steps_between_commits_equal_torch_adamw(make_model_dir, tmp_path, precision, clip, state_cache):
    model_dir, model = make_model_dir("llama")
    data = batches(STEPS)
    kw = dict(lr=1e-2, wd=0.1, clip=clip, accum=1, warmup=2, precision=precision)
    ref_model, ref_master, ref_losses, _ = run_reference(model, data, **kw)
    masters, weights, losses, results = run_engine(model_dir, tmp_path, data, state_cache=state_cache,
                                                   commit_every="3", **kw)
    assert losses == ref_losses
    assert_same(ref_master, masters)
    if precision == "bf16":
        assert_same({n: p.detach() for n, p in ref_model.named_parameters()}, weights)
    if clip is not None:  # between commits the slot is rewritten in place: a clip holds, never redoes
        assert {r.clip_path for r in results} == {"hold"} and not any(r.redone for r in results)


def _train(eng, data, steps, start=0, lr=None):
    """Steps start..start+steps-1 of `data`; lr: the schedule's lr of a step (run_engine's)."""
    for s in range(start, start + steps):
        if lr is not None:
            eng.set_lr(lr(s))
        x = data[s]
        eng.backward(eng.forward(x, labels=x).loss)
        eng.step()
    eng.settle()


def test_only_commits_write_the_kept_state_and_move_the_manifest(make_model_dir, tmp_path):
    model_dir, _ = make_model_dir("llama")
    data = batches(STEPS)
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="bf16", commit_every="3",
                       optim=AdamWConfig(lr=1e-2, max_grad_norm=1.0), tokens_per_micro_batch=data[0].numel())
    eng = Engine.from_pretrained(model_dir, cfg)
    written, step = [], [0]
    write = eng.store.write

    def spy(key, tensor, *a, **k):
        written.append((step[0], key))
        return write(key, tensor, *a, **k)
    eng.store.write = spy
    try:
        steps_committed = []
        for s in range(STEPS):
            step[0] = s + 1
            _train(eng, data, 1, start=s)  # (it settles: the step's writes and commit are done)
            steps_committed.append(read_manifest(list_manifests(eng.root)[0])["step"])
        assert steps_committed == [0, 0, 3, 3, 3]  # the import is step 0's commit, then every 3rd step
        # the whole state fits the cache: steps 1, 2, 4 and 5 wrote no master or moments (step 3's
        # commit wrote them once); the working weights go out every step
        state_writes = {s for s, k in written if k.split("/")[0].rstrip("01") in ("master", "m", "v")}
        assert state_writes == {3}
        assert {s for s, k in written if k.startswith("w")} == {1, 2, 3, 4, 5}
        before = eng.master(eng.names[1])  # an export makes the newest state the committed one
        assert read_manifest(list_manifests(eng.root)[0])["step"] == 5
        assert torch.equal(eng.master(eng.names[1]), before)
    finally:
        eng.close()


def test_resume_takes_the_last_commit_and_replays_to_the_same_bits(make_model_dir, tmp_path):
    model_dir, model = make_model_dir("llama")
    data = batches(STEPS)
    kw = dict(lr=1e-2, wd=0.1, clip=0.5, accum=1, warmup=0, precision="bf16")
    _, ref_master, _, _ = run_reference(model, data, **kw)
    sched = lr_factor("cosine", 0, STEPS)
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nvme"), cpu_mem="1GiB", precision="bf16", commit_every="2",
                       optim=AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5),
                       tokens_per_micro_batch=data[0].numel())
    eng = Engine.from_pretrained(model_dir, cfg)
    _train(eng, data, 3, lr=lambda s: 1e-2 * sched(s))  # commits step 2; step 3 is in RAM only
    eng.store.close()  # the process dies: nothing more lands
    eng = Engine.from_pretrained(model_dir, cfg, resume=True)
    try:
        assert eng.state["step"] == 2
        _train(eng, data, 3, start=2, lr=lambda s: 1e-2 * sched(s))
        masters = {n: eng.master(n) for n in eng.names}
    finally:
        eng.close()
    assert_same(ref_master, masters)


def test_commit_every_values():
    assert parse_commit_every("1").every_step
    assert parse_commit_every("50").steps == 50
    assert parse_commit_every("10min").seconds == 600
    assert parse_commit_every("auto").auto
    for bad in ("0", "-3", "often", "5 parsecs"):
        with pytest.raises(ValueError, match="--commit-every"):
            parse_commit_every(bad)
    with pytest.raises(ValueError, match="--commit-every"):
        EngineConfig(nvme_dir="x", commit_every="sometimes")
    every = parse_commit_every("30s")
    assert not due(every, 1, 7, 5, 29.0) and due(every, 1, 7, 0, 30.0)
    every = parse_commit_every("3")  # the multiples of 3, wherever the run resumed
    assert [n for n in range(1, 10) if due(every, 1, n, 0, 0.0)] == [3, 6, 9]


def test_auto_interval_keeps_the_commit_within_five_percent():
    # 2 GB kept at 1 GB/s plus 0.5 s of sync and manifest: 2.5 s a commit; 10 s steps: 5 steps
    cost = commit_cost_s(2_000_000_000, 1e9, 0.5)
    assert cost == pytest.approx(2.5)
    n = auto_interval(cost, 10.0)
    assert n == 5 and cost <= 0.05 * n * 10.0 and cost > 0.05 * (n - 1) * 10.0
    assert auto_interval(0.0, 10.0) == 1
    assert auto_interval(1e6, 1.0) == 1000  # never more steps than AUTO_MAX_STEPS to replay


def test_the_first_steps_probe_prices_the_auto_interval_where_nothing_was_measured():
    """A first run on a file system measures the drive after step 1, before auto picks the
    interval (after step 2): the pick prices commits at the measured write rate, not an assumed
    one; what `bench io` measured is kept."""
    from tierlm.engine.commit_schedule import CommitSchedule
    from tierlm.plan.activations import Rates
    from tierlm.plan.settings import Measured

    probe = Rates(2e9, 0.7e9, 7e9, "measured at the first step (256 MiB, a child process)")
    s = CommitSchedule("auto", Measured())
    assert "an assumed" in s.rate_why
    s.measured_rates(probe)
    assert s.write_bps == 0.7e9 and "0.70 GB/s (measured at the first step" in s.rate_why
    benched = CommitSchedule("auto", Measured(io={"write_gbps": 1.5}))
    benched.measured_rates(probe)
    assert benched.write_bps == 1.5e9 and "bench io" in benched.rate_why


def test_the_drive_probe_between_two_steps_is_not_the_next_steps_time():
    """The probe runs after step 1 ends; the interval is priced on step 2's time, which it must not
    inflate (on a 2-core VM a 5 s probe made a 2 s step read 7 s, and the interval too short)."""
    import time

    from tierlm.engine.commit_schedule import CommitSchedule
    from tierlm.plan.activations import Rates
    from tierlm.plan.settings import Measured

    s = CommitSchedule("auto", Measured())
    s.step_ended(True, 0)
    t = time.perf_counter()
    time.sleep(0.3)  # the probe
    s.measured_rates(Rates(2e9, 0.7e9, 7e9, "measured at the first step"), time.perf_counter() - t)
    s.step_ended(True, 0)
    assert s.step_s[-1] < 0.1
    assert "x 0.0" in s.why  # the picked interval's message names the step's own time
