"""`tierlm plan --task serve` on a GPU: the catalog's memory bandwidth and host link, whole layers
placed under --gpu-mem, and the resident (device memory) and streamed (host link, NVMe) bounds."""
import pytest

from tierlm.advise.models import model_shape
from tierlm.cli import main
from tierlm.plan import cost as C
from tierlm.plan import gpu_serve as G
from tierlm.plan.catalog import GB, GPUS, Catalog
from tierlm.plan.planner import Task, plan

MB, GiB = 1000**2, 1 << 30


def test_the_catalog_has_each_gpus_memory_bandwidth_and_host_link():
    want = {"h100-80g": (3350, 63.0), "h100-pcie": (2000, 63.0), "h200": (4800, 63.0), "a100-80g": (2039, 31.5),
            "l4": (300, 31.5), "rtx4090": (1008, 31.5)}
    assert {n: (GPUS[n].mem_gbps, GPUS[n].link_gbps) for n in want} == want
    assert GPUS["h200"].memory_bytes == 141 * GiB and GPUS["h100-pcie"].tflops < GPUS["h100-80g"].tflops


def _bytes(layers=10, layer=100 * MB, kv=50 * MB, fixed=200 * MB):
    return G.DecodeBytes(fixed, fixed // 2, layer, layer, layers, kv, 10 * MB)


def test_layers_stay_whole_and_a_streamed_run_keeps_a_two_layer_copy_window():
    b = _bytes()
    assert G.place(b, 200 * MB + 50 * MB + 10 * MB + 1000 * MB) == 10        # everything fits
    assert G.place(b, 200 * MB + 50 * MB + 10 * MB + 999 * MB) == 7          # 999 MB: window 200, 7 layers
    assert G.place(b, 200 * MB + 50 * MB + 10 * MB + 250 * MB) == 0          # the window alone
    assert G.place(b, 200 * MB + 50 * MB + 10 * MB + 199 * MB) is None       # not even the window


def test_resident_and_streamed_bounds_are_bytes_over_their_rates():
    b = _bytes()
    rates = {"hbm": 2000 * GB, "link": 25 * GB, "ssd": 5 * GB, "compute": 500e12}
    g = G.gpu_decode(b, 200 * MB + 50 * MB + 10 * MB + 700 * MB, ram=300 * MB, flops=2e9, rates=rates, batch=2)
    assert g.resident_layers == 5 and g.device_read == 100 * MB + 10 * 100 * MB + 50 * MB
    assert g.streamed == 500 * MB and g.from_ssd == 200 * MB                 # RAM holds 300 MB of them
    assert g.bounds_s == pytest.approx({"hbm": 1150 * MB / (2000 * GB), "link": 500 * MB / (25 * GB),
                                        "ssd": 200 * MB / (5 * GB), "compute": 2e9 / 500e12})
    assert g.binding == "ssd" and g.to_json()["decode_tokens_per_s"] == pytest.approx(2 / (200 * MB / (5 * GB)))
    resident = G.gpu_decode(b, 10 * GiB, ram=0, flops=2e9, rates=rates, batch=1)
    assert resident.streamed == 0 and resident.binding == "hbm"


def test_plan_prints_the_gpu_bounds_under_gpu_mem():
    cat, shape = Catalog(), model_shape("llama-3.1-8b")
    full = plan(shape, cat.parse("h100-80g+512GiB+pm9a3*4"), Task(kind="serve")).extra["gpu_decode"]
    assert full["streamed_layers"] == 0 and full["binding"] == "hbm"
    hbm = GPUS["h100-80g"].mem_gbps * GB * C.Efficiency().memory
    assert full["bounds_s"]["hbm"] == pytest.approx(full["device_read"] / hbm)
    small = plan(shape, cat.parse("h100-80g+512GiB+pm9a3*4"), Task(kind="serve", gpu_mem=8 * GiB)).extra["gpu_decode"]
    assert 0 < small["resident_layers"] < 32 and small["binding"] == "link"
    link = GPUS["h100-80g"].link_gbps * GB * C.Efficiency().link
    assert small["bounds_s"]["link"] == pytest.approx(small["streamed"] / link)
    assert small["gpu_mem"] == 8 * GiB
    assert "gpu_decode" not in plan(shape, cat.parse("epyc-9124+256GiB+pm9a3"), Task(kind="serve")).extra


def test_the_cli_takes_gpu_mem_and_prints_both_bounds(capsys):
    assert main(["plan", "llama-3.1-8b", "--task", "serve", "--hardware", "h200+512GiB+pm9a3*2", "--gpu-mem", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "on the GPU under --gpu-mem 8.00 GiB:" in out
    assert "resident decode bound:" in out and "streamed layers bound:" in out and "link-bound" in out
    assert main(["plan", "llama-3.1-70b", "--task", "serve", "--hardware", "l4+64GiB+pm9a3", "--gpu-mem", "1GiB"]) == 0
    assert "does not fit: embeddings and head" in capsys.readouterr().out
