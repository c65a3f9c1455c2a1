"""Generation with layers on a compute device (tierlm.infer.device_layers, device_run,
plan.device_placement).

Without a GPU: the placement under --gpu-mem, the copy schedule (next layer's copy issued before
this one computes, a host buffer given back only after its copy has read it) on synchronous copies,
and the engine with the device schedule forced on the CPU giving the CPU path's bits. The flags'
errors. With a GPU (skipped here): greedy output against transformers' generate on the same GPU.
"""
import pytest
import torch

from tierlm.infer.batcher import Batcher, Request
from tierlm.infer.device_layers import DeviceLayers, HostLayers, SyncLane
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.sampling import SamplingParams
from tierlm.plan.device_placement import DEVICE_WINDOW_LAYERS, plan_device_placement
from tierlm.storage import BudgetError
from ..memory import held_now

MiB = 1 << 20
PROMPTS = [[(7 * i + 3) % 120 + 1 for i in range(20)], [100, 7, 42]]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---- placement: pure arithmetic ----------------------------------------------------------------
def test_placement_keeps_every_layer_when_they_fit():
    p = plan_device_placement(100 * MiB, fixed=10 * MiB, layer_bytes=8 * MiB, layers=8, kv=4 * MiB, scratch=6 * MiB)
    assert (p.resident, p.streamed, p.window) == (8, 0, 0)


def test_placement_streams_the_rest_through_a_window_of_two_layers():
    # 100 - 10 - 4 - 6 = 80 MiB for layers; 12 layers of 8 MiB do not fit; window 16 MiB; 64 / 8 = 8 resident
    p = plan_device_placement(100 * MiB, fixed=10 * MiB, layer_bytes=8 * MiB, layers=12, kv=4 * MiB, scratch=6 * MiB)
    assert p.window == DEVICE_WINDOW_LAYERS * 8 * MiB
    assert (p.resident, p.streamed) == (8, 4)
    assert p.fixed + p.kv + p.scratch + p.window + p.resident * p.layer_bytes <= p.budget
    assert "8/12 layers in device memory" in p.describe()


def test_placement_honours_resident_layers_and_zero():
    kw = dict(fixed=MiB, layer_bytes=MiB, layers=6, kv=MiB, scratch=MiB)
    assert plan_device_placement(1 << 30, want=2, **kw).resident == 2
    assert plan_device_placement(1 << 30, want=0, **kw).resident == 0
    assert plan_device_placement(1 << 30, want=99, **kw).resident == 6


def test_placement_too_small_names_gpu_mem_and_the_need():
    with pytest.raises(BudgetError) as e:
        plan_device_placement(20 * MiB, fixed=10 * MiB, layer_bytes=8 * MiB, layers=4, kv=4 * MiB, scratch=2 * MiB)
    msg = str(e.value)
    assert "--gpu-mem" in msg and "32.00 MiB is needed" in msg  # 10 + 4 + 2 + 2 x 8


# ---- the schedule on synchronous copies ----------------------------------------------------------
class _Piece:
    def __init__(self, key):
        self.key, self.t = key, None

    def install(self, t):
        self.t = t


class _Lane(SyncLane):
    """SyncLane whose events say whether `finished` has been called on them."""

    def copy(self, host):
        out, _ = super().copy(host)
        return out, {"finished": False}

    def finished(self, event):
        event["finished"] = True


class _Window:
    """A store's window as the schedule sees it (LayerStream.take / release), checking that a
    buffer goes back only once its copy has finished and is never taken twice."""

    def __init__(self, layers, sched_ref, log):
        self.layers, self.sched, self.log, self.held = set(layers), sched_ref, log, set()

    def take(self, i):
        assert i not in self.held
        self.held.add(i)
        return {f"w{i}": torch.full((4,), float(i))}

    def release(self, i):
        _, ev = self.sched[0].released_event
        assert ev["finished"], f"layer {i}'s host buffer released before its copy finished"
        self.held.discard(i)
        self.log.append(("buffer back", i))


class _Recording(DeviceLayers):
    def after(self, i):
        self.released_event = self._inflight[i]
        super().after(i)


def _schedule(layers, in_ram):
    log, ref = [], []
    pieces = {i: [_Piece(f"w{i}")] for i in layers}
    window = _Window([i for i in layers if i not in in_ram], ref, log)
    host = HostLayers({i: {f"w{i}": torch.full((4,), float(i))} for i in in_ram}, window)
    sched = _Recording(_Lane(torch.device("cpu")), pieces, host, log=log)
    ref.append(sched)
    return sched, pieces, window, log


@pytest.mark.parametrize("in_ram", [(), (1, 3), (1, 2, 3, 4)], ids=["all-from-store", "mixed", "all-in-ram"])
def test_next_copy_is_issued_before_this_layer_computes(in_ram):
    layers = [1, 2, 3, 4]
    sched, pieces, window, log = _schedule(layers, set(in_ram))
    for step in range(3):
        sched.start_step()
        for i in layers:
            sched.before(i)
            assert torch.equal(pieces[i][0].t, torch.full((4,), float(i)))  # its own bytes, on the "device"
            assert len(sched.on_device()) <= DEVICE_WINDOW_LAYERS
            sched.after(i)
            assert pieces[i][0].t is None
    events = [e for e in log if e[0] != "buffer back"]
    computes = [k for k, e in enumerate(events) if e[0] == "compute"]
    assert len(computes) == 3 * len(layers)
    for k in computes:
        i = events[k][1]
        nxt = layers[(layers.index(i) + 1) % len(layers)]
        before = events[:k]
        # the copy this compute uses, and the next layer's, were issued before it (since the last release of each)
        for j in (i, nxt):
            last_copy = max(n for n, e in enumerate(before) if e == ("copy", j))
            assert all(e != ("release", j) for e in before[last_copy:]), (i, j, events)
    # each layer copied once a step: decode repeats the walk without copying a layer twice
    assert sum(e[0] == "copy" for e in events) == 3 * len(layers) + 1  # + the next step's first layer
    # buffers from the store go back once each per step, after their release, and the last one is held
    assert sum(e[0] == "buffer back" for e in log) == 3 * (len(layers) - len(in_ram))
    sched.close()
    assert not window.held


def test_one_streamed_layer_is_its_own_next():
    sched, pieces, window, log = _schedule([5], set())
    for _ in range(2):
        sched.before(5)
        sched.after(5)
    assert [e for e in log if e[0] != "buffer back"] == [("copy", 5), ("compute", 5), ("release", 5)] * 2


# ---- the engine with the device schedule on the CPU ----------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.conftest import tiny_model
    d = tmp_path_factory.mktemp("device") / "llama-bf16"
    tiny_model("llama", intermediate_size=128, initializer_range=0.3).to(torch.bfloat16).save_pretrained(d)
    return d


def _steps(d, store, **kw):
    """Both prompts' prefill together, then 5 decode steps of both: every step's logits, and the
    schedule's events where it runs."""
    cfg = InferConfig(cpu_mem="1GiB", nvme_dir=str(store), max_batch=2, max_seq_len=40, lean=False, prefetch=1, **kw)
    eng = InferenceEngine(d, cfg, library_rss=held_now())
    log = None
    if eng.dev and eng.dev.layers:
        log = eng.dev.layers.log = []
    try:
        out = [eng.step(PROMPTS, [0, 0])]
        starts = [len(p) for p in PROMPTS]
        for t in range(5):
            out.append(eng.step([[(13 * t + 1) % 120 + 1], [(5 * t + 2) % 120 + 1]], starts))
            starts = [s + 1 for s in starts]
        return out, log, eng.dev
    finally:
        eng.close()


PLACES = {"device-resident": {}, "from-ram": dict(resident_layers=1),
          "from-store": dict(resident_layers=0, host_resident_layers=0),
          "ram-and-store": dict(resident_layers=0, host_resident_layers=1)}


@pytest.mark.parametrize("weights", ["bf16", "int8"])
@pytest.mark.parametrize("place", list(PLACES))
def test_device_schedule_on_the_cpu_gives_the_cpu_paths_bits(model_dir, tmp_path, weights, place):
    ref, _, dev = _steps(model_dir, tmp_path / "ref", weights=weights)
    assert dev is None
    got, log, dev = _steps(model_dir, tmp_path / "dev", weights=weights, device_schedule=True, gpu_mem="1GiB",
                           **PLACES[place])
    assert dev is not None
    streamed = dev.placement.streamed
    assert streamed == (0 if place == "device-resident" else 3 - PLACES[place]["resident_layers"])
    bad = [k for k, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b)]
    assert not bad, f"step {bad[0]} differs: max |diff| {(got[bad[0]] - ref[bad[0]]).abs().max().item():.3g}"
    if streamed:
        assert sum(e[0] == "compute" for e in log) == 6 * streamed  # each streamed layer once a step
        assert sum(e[0] == "copy" for e in log) == 6 * streamed + 1


def test_device_schedule_greedy_equals_the_default_cpu_path(tmp_path, make_model_dir):
    """fp32, batched with prompts joining and leaving: the same tokens as the default CPU engine
    (its native decoder included)."""
    d, _ = make_model_dir("llama", initializer_range=0.3)
    prompts = [[5, 9, 17, 3, 44], [100, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 1]]

    def greedy(**kw):
        cfg = InferConfig(cpu_mem="1GiB", dtype="fp32", nvme_dir=str(tmp_path / f"nvme{len(kw)}"), max_batch=2,
                          max_seq_len=40, step_tokens=4, **kw)
        eng = InferenceEngine(d, cfg, library_rss=held_now())
        try:
            b = Batcher(eng, _Tok(), [])
            reqs = [b.submit(Request(list(p), SamplingParams(max_tokens=n))) for p, n in zip(prompts, (12, 5, 9))]
            b.run_until_idle()
            return [r.out_ids for r in reqs]
        finally:
            eng.close()

    ref = greedy()
    assert greedy(device_schedule=True, gpu_mem="1GiB", resident_layers=1, host_resident_layers=1) == ref


class _Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_device_schedule_refuses_a_gpu_mem_that_cannot_hold_it(model_dir, tmp_path):
    with pytest.raises(BudgetError, match="--gpu-mem"):
        InferenceEngine(model_dir, InferConfig(cpu_mem="1GiB", nvme_dir=str(tmp_path), device_schedule=True,
                                               gpu_mem="64KiB", max_seq_len=40), library_rss=held_now())


# ---- the flags -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:banana"], "--device"),
    (["--gpu-mem", "lots"], "--gpu-mem"),
    (["--gpu-mem", "0"], "--gpu-mem"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device")]))
@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_bad_device_flags_exit_2_naming_the_flag(tiny, capsys, flags, named, verb):
    from tierlm.cli import main
    args = [verb, str(tiny), "--cpu-mem", "1GiB"] + (["--prompt", "hi", "--max-new-tokens", "2"] if verb == "generate"
                                                    else ["--port", "1"])
    assert main(args + flags) == 2
    err = capsys.readouterr().err
    assert named in err and "error" in err


# ---- on a GPU (skipped without one) ----------------------------------------------------------------
NEW = 16
GPU_PROMPTS = [[5, 9, 17, 3, 44], [100, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 1]]
BF16_SAME_TOKENS = 8     # bf16: the first 8 greedy tokens equal transformers' on the same GPU
BF16_LOGIT_TOL = 0.03    # ... and every step's logits within 3% of the largest, teacher-forced


def _gpu_engine(d, tmp_path, place, **kw):
    # library_rss=0: the process's whole RSS (CUDA's libraries and context included) is its baseline
    cfg = InferConfig(cpu_mem="16GiB", nvme_dir=str(tmp_path / f"nvme-{place}"), max_batch=1, max_seq_len=48,
                      device="cuda", **PLACES[place], **kw)
    return InferenceEngine(d, cfg, library_rss=0)


def _greedy(eng, prompts, new=NEW):
    out = []
    for p in prompts:
        b = Batcher(eng, _Tok(), [])
        r = b.submit(Request(list(p), SamplingParams(max_tokens=new)))
        b.run_until_idle()
        out.append(r.out_ids)
    return out


def _reference(model, prompts, new=NEW):
    out = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        g = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def _dequantised_int8(model):
    """The model with each decoder layer's linear weights as tierlm's int8 holds them (q * scale)."""
    from tierlm.infer.quant import QLinear, quantizable
    for layer in model.model.layers:
        for _, (mod, conv) in quantizable(layer, "int8").items():
            w = mod.weight.data
            q = QLinear(w.shape[1], w.shape[0], "int8").quantize(w, None, w.dtype)
            mod.weight.data = (q["qweight"].to(w.dtype) * q["scales"].to(w.dtype)[:, None]).to(w.dtype)
    return model


@cuda
@pytest.mark.parametrize("weights", ["fp32", "int8"])
@pytest.mark.parametrize("place", list(PLACES))
def test_gpu_greedy_fp32_equals_transformers_on_the_gpu(make_model_dir, tmp_path, weights, place):
    d, model = make_model_dir("llama", initializer_range=0.3)
    if weights == "int8":
        model = _dequantised_int8(model)
    refs = _reference(model.cuda().eval(), GPU_PROMPTS)
    eng = _gpu_engine(d, tmp_path, place, dtype="fp32", weights=weights if weights == "int8" else "fp32")
    try:
        assert eng.cache.k[0].device.type == "cuda"
        assert (eng.dev.placement.streamed > 0) == (place != "device-resident")
        assert _greedy(eng, GPU_PROMPTS) == refs
    finally:
        eng.close()


@cuda
@pytest.mark.parametrize("place", list(PLACES))
def test_gpu_greedy_bf16_within_tolerance_of_transformers(tmp_path, place):
    from tests.conftest import tiny_model
    d = tmp_path / "llama-bf16"
    model = tiny_model("llama", initializer_range=0.3).to(torch.bfloat16)
    model.save_pretrained(d)
    model = model.cuda().eval()
    refs = _reference(model, GPU_PROMPTS)
    eng = _gpu_engine(d, tmp_path, place, weights="bf16")
    try:
        got = _greedy(eng, GPU_PROMPTS)
        for g, r in zip(got, refs):
            assert g[:BF16_SAME_TOKENS] == r[:BF16_SAME_TOKENS]
        # teacher-forced on transformers' tokens: each step's logits against its forward's
        for p, r in zip(GPU_PROMPTS, refs):
            seq = p + r
            with torch.no_grad():
                want = model(torch.tensor([seq], device="cuda")).logits[0, len(p) - 1:-1].float().cpu()
            got_l = [eng.step([p], [0])[0]] + [eng.step([[t]], [len(p) + k])[0] for k, t in enumerate(r[:-1])]
            err = (torch.stack(got_l) - want).abs().max().item() / want.abs().max().item()
            assert err <= BF16_LOGIT_TOL, f"{place}: logits differ by {err:.3g} of the largest"
    finally:
        eng.close()


@cuda
def test_gpu_streamed_layers_are_copied_once_a_step(make_model_dir, tmp_path):
    d, _ = make_model_dir("llama", initializer_range=0.3)
    eng = _gpu_engine(d, tmp_path, "from-store", dtype="fp32", weights="fp32")
    try:
        eng.dev.layers.log = []
        _greedy(eng, GPU_PROMPTS[:1], new=4)
        log = eng.dev.layers.log
        assert sum(e[0] == "compute" for e in log) == 4 * eng.dev.placement.streamed
        assert eng.stream.pool.pin
    finally:
        eng.close()


@cuda
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_gpu_continuous_batch_equals_transformers(make_model_dir, tmp_path, packed):
    """Sequences joining and leaving the batch, prompts prefilled in chunks, a layer streamed: each
    sequence's tokens are transformers' alone (fp32). Runs the KV cache's GPU write indices."""
    d, model = make_model_dir("llama", initializer_range=0.3)
    prompts = GPU_PROMPTS + [[3] * 9, [60, 61, 62]]
    lens = [10, 4, 10, 7, 10]
    refs = _reference(model.cuda().eval(), prompts, 10)
    cfg = InferConfig(cpu_mem="16GiB", dtype="fp32", nvme_dir=str(tmp_path / "nvme"), max_batch=3, max_seq_len=40,
                      step_tokens=4, resident_layers=1, packed=packed, device="cuda")
    eng = InferenceEngine(d, cfg, library_rss=held_now())
    try:
        b = Batcher(eng, _Tok(), [])
        reqs = [b.submit(Request(list(p), SamplingParams(max_tokens=n))) for p, n in zip(prompts, lens)]
        b.run_until_idle()
    finally:
        eng.close()
    assert [r.out_ids for r in reqs] == [ref[:n] for ref, n in zip(refs, lens)]
