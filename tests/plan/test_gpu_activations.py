"""The activation planner with a GPU computing: kept activations hold GPU memory (--gpu-mem), a
swapped layer's cross the host link out in forward and back in backward on a side stream, beside
the compute (a phase takes the longer of the two), and swap-host / swap is chosen where it beats
recomputing, keep where GPU memory has room, recompute where the copies would outlast the compute
they hide behind."""
import pytest

from tierlm.plan import activations as P

MB = 1000**2
GB = 1000**3


def _layers(n=8, fwd=0.010, act=100 * MB):
    """A fast GPU's layers: 10 ms forward, 20 ms backward, 100 MB saved."""
    return [P.LayerProfile(i + 1, fwd, 2 * fwd, act) for i in range(n)]


def _gpu(link=25 * GB, ssd=6 * GB):
    """A 25 GB/s host link (a PCIe 4/5 x16 card's pinned copies), NVMe at 6 GB/s."""
    return P.Rates(ssd, ssd, 20 * GB, "test", d2h=link, h2d=link)


def _count(plan, policy):
    return list(plan.policies.values()).count(policy)


def test_the_link_prices_each_direction_in_its_phase():
    layers = _layers(2)
    pred = P.predict(layers, {1: "swap-host", 2: "keep"}, P.Rates(1e9, 1e9, 1e12, d2h=10 * GB, h2d=20 * GB), P.Base())
    assert pred["copy_s"] == pytest.approx(100 * MB / (10 * GB))        # out, in forward
    assert pred["copy_bwd_s"] == pytest.approx(100 * MB / (20 * GB))    # back, in backward
    # overlapped with the layers' compute: each phase takes the longer of its compute and its copies
    assert pred["forward_s"] == pytest.approx(0.020)
    assert pred["backward_s"] == pytest.approx(0.040)
    assert pred["bound_fwd"] == pred["bound_bwd"] == "compute"
    # copies longer than the compute they overlap bind the phase: the link
    slow = P.predict(layers, {1: "swap-host", 2: "swap-host"}, P.Rates(1e9, 1e9, 1e12, d2h=5 * GB, h2d=20 * GB), P.Base())
    assert slow["forward_s"] == pytest.approx(2 * 100 * MB / (5 * GB)) and slow["bound_fwd"] == "link"
    assert slow["backward_s"] == pytest.approx(0.040) and slow["bound_bwd"] == "compute"


def test_the_cpu_prices_its_staging_copies_as_added_compute():
    layers = _layers(2)
    pred = P.predict(layers, {1: "swap", 2: "keep"}, P.Rates(100 * GB, 100 * GB, 10 * GB), P.Base())
    assert pred["forward_s"] == pytest.approx(0.020 + 0.010)  # two layers' compute + the copy
    assert pred["bound_fwd"] == "compute"


def test_swaps_to_host_where_the_link_beats_recompute_and_keeps_what_gpu_memory_holds():
    # 100 MB over 25 GB/s: 4 ms out + 4 ms back, against a 10 ms recompute; 300 MB of GPU memory keeps 3
    plan = P.choose_gpu(_layers(), 300 * MB, 10 * GB, 200 * MB, _gpu(), P.Base())
    assert (_count(plan, "keep"), _count(plan, "swap-host"), _count(plan, "recompute")) == (3, 5, 0)
    assert plan.pool == 5 * 100 * MB  # the pinned host pool holds the swapped layers until backward
    assert plan.predicted["step_s"] < P.choose_gpu(_layers(), 300 * MB, 0, 0, _gpu(), P.Base()).predicted["step_s"]
    assert "swap-host 5" in plan.reason


def test_swaps_to_host_where_copies_slower_than_recompute_hide_behind_compute():
    # 100 MB over 5 GB/s: 20 ms each way, slower than the layer's 10 ms recompute, but on the side
    # stream: the forward's 80 ms of compute hides 4 layers' copies out (the backward's 160 ms,
    # their copies back); a 5th would make the forward 100 ms where recomputing it costs 10 ms
    plan = P.choose_gpu(_layers(), 300 * MB, 10 * GB, 200 * MB, _gpu(link=5 * GB), P.Base())
    assert (_count(plan, "keep"), _count(plan, "swap-host"), _count(plan, "recompute")) == (3, 4, 1)
    assert plan.pool == 4 * 100 * MB
    assert plan.predicted["forward_s"] == pytest.approx(0.080)
    assert plan.predicted["backward_s"] == pytest.approx(0.160 + 0.010)


def test_recomputes_where_the_link_is_slower_than_the_compute_it_overlaps():
    # 100 MB over 1 GB/s: 100 ms each way, more than the whole forward's compute
    plan = P.choose_gpu(_layers(), 300 * MB, 10 * GB, 200 * MB, _gpu(link=1 * GB), P.Base())
    assert (_count(plan, "keep"), _count(plan, "recompute")) == (3, 5)
    assert plan.pool == 0


def test_keeps_everything_that_gpu_memory_holds():
    plan = P.choose_gpu(_layers(), 800 * MB, 10 * GB, 200 * MB, _gpu(), P.Base())
    assert set(plan.policies.values()) == {"keep"} and plan.pool == 0


def test_swaps_on_to_nvme_when_the_host_pool_is_full_and_the_drive_keeps_up():
    # 350 MB of host RAM: 3 layers fit the pinned pool; with 200 MB of it staging for NVMe, 1 does
    # and the other 4 swap on to the drive (no recompute at all)
    fast = P.choose_gpu(_layers(), 300 * MB, 350 * MB, 200 * MB, _gpu(ssd=6 * GB), P.Base())
    assert [fast.policies[i] for i in range(1, 9)] == ["keep"] * 3 + ["swap-host"] + ["swap"] * 4
    assert fast.pool == 100 * MB + 200 * MB  # the swap-host layer and the staging
    # a drive too slow for the swapped bytes would bind the step: 3 to host, 2 recompute
    slow = P.choose_gpu(_layers(), 300 * MB, 350 * MB, 200 * MB, _gpu(ssd=0.5 * GB), P.Base())
    assert [slow.policies[i] for i in range(1, 9)] == ["keep"] * 3 + ["swap-host"] * 3 + ["recompute"] * 2
    assert slow.pool == 300 * MB
    assert fast.predicted["step_s"] < slow.predicted["step_s"]


def test_the_cpu_planner_is_unchanged_by_the_link_fields():
    # the same profile priced with and without the (absent) link: the CPU's staging copy rate
    layers = [P.LayerProfile(i, 1.0, 2.0, 100 * 2**20) for i in range(8)]
    a = P.choose(layers, 300 * 2**20, 200 * 2**20, P.Rates(2e9, 2e9, 1e10), P.Base())
    assert (_count(a, "keep"), _count(a, "swap")) == (1, 7)
    assert a.predicted["copy_s"] == a.predicted["copy_bwd_s"]
    assert "swap-host" not in a.reason


def test_describe_names_the_link_only_with_a_gpu():
    assert "GPU link" not in P.describe(P.Rates(1e9, 1e9, 1e10))
    assert "GPU link 25.0 GB/s to host, 24.0 GB/s to device" in P.describe(P.Rates(1e9, 1e9, 1e10, d2h=25e9, h2d=24e9))
