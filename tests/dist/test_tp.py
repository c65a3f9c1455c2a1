"""`--tp 2`: two gloo processes on localhost, each holding half of every layer's heads and MLP
width, generate greedily the same tokens as one process (fp32), through the engine and through
`torchrun -m tierlm generate`; a model the split cannot divide, or --tp without torchrun, is refused."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tierlm.infer.batcher import Batcher, Request
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.sampling import SamplingParams

from ..conftest import tiny_model
from ..memory import held_now

SPREAD = {"initializer_range": 0.3}  # peaked next-token distributions: a wrong shard shows as other tokens
PROMPTS = [[5, 9, 2, 77, 31], [3, 3, 8], [100, 4, 60, 12, 7, 1, 90]]  # 3 requests, 2 slots: slots move


class _Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _engine(d, nvme, tp, **kw):
    return InferenceEngine(d, InferConfig(dtype="fp32", cpu_mem="1GiB", max_batch=2, nvme_dir=str(nvme), tp=tp,
                                          **kw), library_rss=held_now())


def _greedy(eng, new=12):
    b = Batcher(eng, _Tok(), [])
    reqs = [b.submit(Request(list(p), SamplingParams(max_tokens=new))) for p in PROMPTS]
    b.run_until_idle()
    return [r.out_ids for r in reqs]


CASES = [("llama", {}), ("qwen2", {"resident_layers": 1})]  # GQA; q/k/v biases, tied head, streamed


def _worker(rank, dirs, tmp):
    torch.set_num_threads(1)
    out = []
    for i, (d, (_, kw)) in enumerate(zip(dirs, CASES)):
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv{i}", rank=rank, world_size=2)
        eng = _engine(d, f"{tmp}/nvme{i}", 2, **kw)
        if rank == 0:
            out.append(_greedy(eng))
        else:
            eng.tp.follow(eng)
        eng.close()  # rank 0 tells the follower to stop; both leave the group
    if rank == 0:
        with open(f"{tmp}/tokens.json", "w") as f:
            json.dump(out, f)


def test_tp2_engine_equals_one_process(make_model_dir, tmp_path):
    dirs, one = [], []
    for arch, kw in CASES:
        d, _ = make_model_dir(arch, **SPREAD)
        dirs.append(str(d))
        one.append(_greedy(_engine(d, tmp_path / f"nvme-one-{arch}", 1, **kw)))
        assert len({t for r in one[-1] for t in r}) > 3  # varied tokens, not one repeated
    mp.spawn(_worker, args=(dirs, str(tmp_path)), nprocs=2, join=True)
    assert json.loads((tmp_path / "tokens.json").read_text()) == one


def test_torchrun_generate_tp2_equals_one_process(tmp_path):
    from transformers import AutoTokenizer

    from tierlm.hf.init import init_model
    from tierlm.hf.presets import make_config

    cfg = make_config("llama", None, {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 96,
                                      "vocab": 512, "initializer_range": 0.3})
    model = init_model(tmp_path / "model", cfg, dtype="float32")
    prompt = "The weather today"
    eng = _engine(model, tmp_path / "nvme", 1)
    b = Batcher(eng, _Tok(), [])
    one = b.submit(Request(AutoTokenizer.from_pretrained(model)(prompt).input_ids,
                           SamplingParams(max_tokens=10, ignore_eos=True)))
    b.run_until_idle()
    out = tmp_path / "two.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        "29517", "-m", "tierlm", "generate", str(model), "--prompt", prompt, "--weights", "fp32",
                        "--max-new-tokens", "10", "--ignore-eos", "--json", str(out), "--tp", "2"],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(out.read_text())["token_ids"] == one.out_ids and len(set(one.out_ids)) > 1
    assert r.stderr.count("tierlm generate:") == 1  # rank 0 alone reports


def test_refused_when_the_split_does_not_divide_or_no_torchrun(make_model_dir, tmp_path):
    from tierlm.dist.tp import TensorParallel, init
    from tierlm.hf.structure import discover_blocks, empty_model

    model = empty_model(tiny_model("llama").config)
    blocks, _ = discover_blocks(model)
    with pytest.raises(ValueError, match="--tp 3 must divide the model's attention heads"):
        TensorParallel(0, 3).shard(model, [b.module for b in blocks if b.kind == "layer"], model.config)
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
            init(2)
    finally:
        os.environ.update(env)
