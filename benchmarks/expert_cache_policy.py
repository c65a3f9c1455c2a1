"""The expert cache's policies side by side: hit rate and decode tok/s of lfu and lru on one model,
at a few cache sizes, the same prompt and tokens (the policy changes what is read, never what is
computed: the tokens are checked equal).

    python benchmarks/expert_cache_policy.py MODEL_DIR --cpu-mem 2500MiB --shares 0.25,0.5 --tokens 96

A share sizes the cache as that part of all the model's experts (at least one layer's); the rest of
--cpu-mem is left unused, so each policy sees the same cache.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierlm.bench.machine import machine_line  # noqa: E402
from tierlm.infer import engine as engine_mod  # noqa: E402
from tierlm.infer.engine import InferConfig, InferenceEngine  # noqa: E402
from tierlm.plan.expert_placement import plan_expert_placement  # noqa: E402

PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type made it "
          "possible to copy books quickly and cheaply. Within fifty years presses had spread")


def run(model: str, cpu_mem: str, share: float, policy: str, tokens: int, weights: str, nvme: str,
        threads: int) -> dict:
    def sized(*a, **k):
        p = plan_expert_placement(*a, **k)
        want = max(p.experts, int(share * p.experts * p.moe_layers)) * p.slot_bytes
        p.cache = min(p.cache, want)
        return p
    engine_mod.plan_expert_placement = sized
    try:
        eng = InferenceEngine(model, InferConfig(cpu_mem=cpu_mem, weights=weights, max_batch=1, max_seq_len=512,
                                                 nvme_dir=nvme, expert_policy=policy, threads=threads))
    finally:
        engine_mod.plan_expert_placement = plan_expert_placement
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]
    try:
        lg = eng.step([ids], [0])
        out, n = [], len(ids)
        t0 = time.perf_counter()
        for _ in range(tokens):
            out.append(int(lg[0].argmax()))
            lg = eng.step([[out[-1]]], [n])
            n += 1
        dt = time.perf_counter() - t0
        s = eng.expert_stats()
        return {"slots": eng.streamed_experts.cache.slots, "hit_rate": s.hit_rate, "tok_s": tokens / dt,
                "ssd_mb_token": s.miss_bytes / 1e6 / (tokens + 1), "tokens": out}
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cpu-mem", default="2500MiB")
    ap.add_argument("--shares", default="0.25,0.5")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nvme", default="runs/expert-policy-store")
    a = ap.parse_args()
    print(machine_line())
    print(f"{a.model}, --weights {a.weights}, {a.tokens} decode tokens after a {len(PROMPT.split())}-word prompt")
    print("| cache (share of all experts) | policy | slots | hit rate | SSD MB a token | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for share in (float(x) for x in a.shares.split(",")):
        seen = {}
        for policy in ("lfu", "lru"):
            r = run(a.model, a.cpu_mem, share, policy, a.tokens, a.weights, a.nvme, a.threads)
            seen[policy] = r["tokens"]
            print(f"| {share:.0%} | {policy} | {r['slots']} | {100 * r['hit_rate']:.1f}% | {r['ssd_mb_token']:.1f} | "
                  f"{r['tok_s']:.1f} |", flush=True)
        assert seen["lfu"] == seen["lru"], "the policies decoded different tokens"


if __name__ == "__main__":
    main()
