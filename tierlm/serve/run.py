"""What `tierlm generate` and `tierlm chat` do, and the engine and sampling settings all three
inference verbs build from their options (tierlm/serve/options.py)."""
from __future__ import annotations

import json
import sys

from ..bench import rooflines
from ..config import to_dict
from ..hf import checks  # called through the module: tests replace its checks
from ..hf.tokenizer import chat_ids
from ..infer.batcher import Batcher, Request, eos_ids_of
from ..infer.engine import InferConfig, InferenceEngine
from ..infer.sampling import SamplingParams
from ..rss import peak_rss
from ..units import count
from .options import ChatConfig, EngineOptions, GenerateConfig
from .report import read_past_the_roofline, report


def infer_config(args: EngineOptions, max_batch: int, max_seq_len: int | None) -> InferConfig:
    dtype = args.dtype or ("fp32" if args.weights == "fp32" else "bf16")
    weights = args.weights if args.weights in ("int8", "int4") else dtype
    if args.weights in ("bf16", "fp32") and args.dtype and args.dtype != args.weights:
        raise ValueError(f"--weights {args.weights} with --dtype {args.dtype}: give one of them "
                         "(the unquantised weights are held in the compute dtype)")
    return InferConfig(cpu_mem=args.cpu_mem, dtype=dtype, weights=weights, nvme_dir=args.nvme,
                       max_batch=max_batch, max_seq_len=args.max_seq_len or max_seq_len,
                       step_tokens=args.step_tokens, prefetch=args.prefetch,
                       resident_layers=args.resident_layers, threads=args.threads, tp=args.tp,
                       expert_policy=args.expert_cache, device=args.device, gpu_mem=args.gpu_mem)


def sampling(args) -> SamplingParams:
    p = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, seed=args.seed, stop=list(args.stop),
                       ignore_eos=getattr(args, "ignore_eos", False))
    p.check()
    return p


def load(model_dir, cfg: InferConfig, tok=None):
    checks.check_model_dir(model_dir)
    tok = tok or checks.load_tokenizer(model_dir)
    eng = InferenceEngine(model_dir, cfg)
    if eng.tp and eng.tp.rank:
        # a tensor-parallel follower replays rank 0's steps, then the process ends: the command's
        # output, the server and the sampling are rank 0's alone
        eng.tp.follow(eng)
        eng.close()
        raise SystemExit(0)
    return eng, tok, Batcher(eng, tok, eos_ids_of(tok, model_dir))


def _chat_ids(tok, messages) -> list[int]:
    try:
        return chat_ids(tok, messages)
    except ValueError as e:
        if getattr(tok, "chat_template", None):
            raise
        raise ValueError(f"{e}; use `tierlm generate` with a plain prompt") from None


class GenerationFailed(RuntimeError):
    """A step of the model failed while generating (the batcher fails the request, as the server
    must go on): the command says why and exits 1, where it used to print nothing and exit 0."""


def _failed(req) -> None:
    if req.error:
        raise GenerationFailed(f"the model's step failed, so nothing more was generated ({req.error})")


def generate_cmd(args: GenerateConfig, out=None, err=None) -> dict:
    """`tierlm generate`: stream the completion to `out`, the phase report to `err` (default: the
    process's stdout and stderr at the call)."""
    out, err = out or sys.stdout, err or sys.stderr

    checks.check_model_dir(args.model)
    tok = checks.load_tokenizer(args.model)
    params = sampling(args)
    ids = _chat_ids(tok, [{"role": "user", "content": args.prompt}]) if args.chat \
        else tok(args.prompt).input_ids
    if not ids:
        raise ValueError("--prompt encodes to no tokens; give some text")
    cfg = infer_config(args, args.batch, len(ids) + params.max_tokens)
    eng, tok, batcher = load(args.model, cfg, tok)
    print(f"tierlm generate: {eng.describe()}; loaded in {eng.load_s:.2f} s"
          + (f", wrote {eng.store_written / 1e6:.0f} MB to the store" if eng.store_written else ""), file=err)
    reqs = []
    for b in range(args.batch):
        on_text = (lambda d: (out.write(d), out.flush())) if b == 0 else None
        reqs.append(batcher.submit(Request(list(ids), params, on_text=on_text)))
    batcher.run_until_idle()
    out.write("\n")
    out.flush()
    if any(r.error for r in reqs):
        eng.close()
        _failed(next(r for r in reqs if r.error))
    rates, lines, rep = rated_report(batcher, eng, reqs, err)
    for line in lines:
        print(line, file=err)
    # the run's automatic choices, as describe() printed them at the start: the placement under
    # --cpu-mem (plan.inference, what `tierlm plan --task serve` predicts) and the decode path
    rep.update({"placement": eng.placement.__dict__, "decode_path": eng.decode_path(), "completion_tokens": [len(r.out_ids) for r in reqs],
                "text": reqs[0].text, "token_ids": reqs[0].out_ids, "rates": rates, "config": to_dict(args)})
    rep["peak_rss_bytes"], rep["library_rss_bytes"] = peak_rss(), eng.library_rss
    # freed memory kept for reuse between layers (tierlm/heap.py), and how often it went back
    rep["heap_kept"], rep["heap_trims"] = eng.heap.active, eng.heap.trims
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    eng.close()
    return rep


def rated_report(batcher, engine, requests, err) -> tuple[dict, list[str], dict]:
    """(rates, lines, report): the phase report against this machine's cached rooflines.

    A phase that read memory faster than the cached roofline proves the roofline low: the memory is
    measured again, once, and the roofline is the faster of the two, kept in the cache."""

    nvme = str(engine.store.root) if getattr(engine, "store", None) else None
    rates = rooflines.machine_rates(nvme)
    lines, out = report(batcher, engine, requests, rates)
    if read_past_the_roofline(out) and not rates.get("remeasured"):
        print("tierlm: a phase read memory faster than the measured roofline; measuring it again", file=err)
        new = rooflines.machine_rates(nvme, fresh=True)
        if new.get("mem_gbps"):
            best = max(new["mem_gbps"], rates.get("mem_gbps") or 0.0)
            rates.update(new)
            rates["mem_gbps"], rates["remeasured"] = best, True
            rooflines.machine_rates(nvme, store={**rates})
            lines, out = report(batcher, engine, requests, rates)
    return rates, lines, out


def chat_cmd(args: ChatConfig, inp=None, out=None, err=None) -> int:
    """`tierlm chat`: a conversation on the terminal; /reset forgets it, /exit (or end of input) ends."""
    inp, out, err = inp or sys.stdin, out or sys.stdout, err or sys.stderr

    cfg = infer_config(args, 1, None)
    eng, tok, batcher = load(args.model, cfg)
    print(f"tierlm chat: {eng.describe()}. Type a message; /reset starts over, /exit ends.", file=err)
    params = sampling(args)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    while True:
        out.write("> ")
        out.flush()
        line = inp.readline()
        if not line or line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = _chat_ids(tok, messages)
        budget = eng.max_len - len(ids)
        if budget < 1:
            print(f"the conversation ({len(ids)} tokens) fills the context ({eng.max_len}); /reset", file=err)
            messages.pop()
            continue
        p = SamplingParams(**{**params.__dict__, "max_tokens": min(params.max_tokens, budget)})
        req = batcher.submit(Request(ids, p, on_text=lambda d: (out.write(d), out.flush())))
        batcher.run_until_idle()
        out.write("\n")
        if req.error:
            eng.close()
            _failed(req)
        messages.append({"role": "assistant", "content": req.text})
        if req.t_first:
            n = len(req.out_ids)
            dec = (req.t_done - req.t_first) / max(n - 1, 1)
            print(f"[{count(n, 'token')}, first after {req.t_first - req.t_submit:.2f} s, then {1 / dec:.1f} tok/s]", file=err)
    eng.close()
    return 0
