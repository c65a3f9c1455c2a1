"""`tierlm VERB ...`: maps verbs to functions and does nothing else."""
from __future__ import annotations

import argparse
import sys

# Building the parser imports no torch or transformers (their import takes seconds): `--help` and
# usage errors answer at once; a verb imports what it needs when it runs. tests/test_cli.py checks.
from . import config as C

EXIT_USAGE = 2


def _cmd_init(args) -> int:
    from .hf.fields import get
    from .hf.init import init_model
    from .hf.presets import make_config, param_count
    from .units import fmt_bytes

    overrides = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate",
                                               "vocab", "max_positions") if getattr(args, k) is not None}
    if args.dtype:
        overrides["dtype"] = args.dtype
    config = make_config(args.arch, args.preset, overrides)
    out = init_model(args.out, config, seed=args.seed, tokenizer_text=args.tokenizer_text or None,
                     overwrite=args.overwrite)
    n = param_count(config)
    print(f"created {out}: {config.model_type}, {n / 1e6:,.1f}M parameters, "
          f"{get(config, 'layers')} layers, hidden {get(config, 'hidden')}; "
          f"training state ~{fmt_bytes(16 * n)} (bf16 weights + fp32 master + Adam moments)")
    return 0


def _cmd_finetune(args) -> int:
    from .train.finetune import FinetuneConfig, finetune

    cfg = C.from_args(FinetuneConfig, args)
    from .dist import in_torchrun
    if in_torchrun():
        from .train.launch import check_not_nested, resume_after_restart
        check_not_nested(cfg)
        resume_after_restart(cfg)
    elif cfg.nproc is not None:
        from .train.launch import launch
        from .train.finetune import _resolve
        return launch(_resolve(cfg))
    if cfg.max_restarts > 0:
        from .train.finetune import _resolve
        from .train.supervise import supervise
        return supervise(_resolve(cfg))
    summary = finetune(cfg)
    if summary.get("final_model"):  # data parallelism: rank 0 reports for all
        _print_summary(summary)
    return 0


def _print_summary(s: dict) -> None:
    from .units import count, fmt_bytes

    beyond = s["peak_rss_bytes"] - s["library_rss_bytes"]
    if not s["steps"]:
        print(f"nothing to do: the run had already finished its steps; model saved to {s['final_model']}")
        return
    print(f"done: {count(s['steps'], 'step')}, loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, "
          f"{s['mean_s_per_step']:.2f} s/step, peak RSS {fmt_bytes(s['peak_rss_bytes'])} = libraries "
          f"{fmt_bytes(s['library_rss_bytes'])} + {fmt_bytes(beyond)} of the {fmt_bytes(s['budget_bytes'])} budget")
    print(f"fine-tuned model: {s['final_model']}")
    if s.get("sample") is not None:
        print(f"sample: {s['sample']!r}")


def _cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(args.dir, cpu_mem=args.cpu_mem, steps=args.steps)
    return 0


# ---- inference verbs: generate, chat, serve (tierlm/serve) ---------------------------------
def _cmd_generate(args) -> int:
    from .serve.options import GenerateConfig
    from .serve.run import generate_cmd

    generate_cmd(C.from_args(GenerateConfig, args))
    return 0


def _cmd_chat(args) -> int:
    from .serve.options import ChatConfig
    from .serve.run import chat_cmd

    return chat_cmd(C.from_args(ChatConfig, args))


def _cmd_serve(args) -> int:
    from .serve.options import ServeConfig
    from .serve.server import serve_cmd

    return serve_cmd(C.from_args(ServeConfig, args))


def _add_infer_verbs(sub) -> None:
    from .serve.options import ChatConfig, GenerateConfig, ServeConfig

    q = sub.add_parser("generate", help="generate from a prompt (weights resident or streamed from NVMe)",
                       description="Generate a completion; prints TTFT, decode tokens/s, GB/s and the bound.")
    C.add_arguments(q, GenerateConfig, positional=("model",))
    q.set_defaults(fn=_cmd_generate)

    q = sub.add_parser("chat", help="chat with a model on the terminal")
    C.add_arguments(q, ChatConfig, positional=("model",))
    q.set_defaults(fn=_cmd_chat)

    q = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (127.0.0.1 by default)")
    C.add_arguments(q, ServeConfig, positional=("model",))
    q.set_defaults(fn=_cmd_serve)


# ---- plan and bench (the planner's verbs) ------------------------------------------------------

def _cmd_plan(args) -> int:
    from .advise.command import run_plan
    from .plan.planner import Task
    from .units import parse_bytes

    task = Task(kind=args.task, batch=args.batch, seq_len=args.seq_len, new_tokens=args.tokens,
                activations=args.activations, state_cache=not args.no_state_cache,
                cpu_mem=parse_bytes(args.cpu_mem, "--cpu-mem") if args.cpu_mem else None, precision=args.precision,
                clip=args.clip, weights=args.weights)
    plans = run_plan(args.model, task, args.hardware, compare=args.compare, json_path=args.json,
                     chart_path=args.chart, catalog_file=args.catalog, nvme=args.nvme)
    return 0 if args.compare or plans[0].fits else 1


def _cmd_bench(args) -> int:
    from .advise.command import bench_text, run_bench
    from .units import parse_bytes

    if args.what == "train":
        import shlex

        from .train.bench_train import bench_train, report
        if not args.model or not args.data:
            raise ValueError("bench train needs MODEL and --data FILE")
        r = bench_train(args.model, args.data, args.cpu_mem, args.steps, args.work,
                        shlex.split(args.finetune_args or ""), nvme=None if args.nvme == "." else args.nvme,
                        inmemory=args.inmemory)
        print(report(r))
        return 0
    res = run_bench(args.what, args.nvme, size=parse_bytes(args.size, "--size"))
    print(bench_text(args.what, res))
    return 0


def _add_plan_verbs(sub) -> None:
    q = sub.add_parser("plan", help="which hardware, which placement, how fast, at what cost",
                       description="Plan fine-tuning or serving MODEL on HARDWARE: placement per tier, each "
                                   "resource's time and the binding one, throughput, cost per million tokens.")
    q.add_argument("model", help="a Hugging Face model directory, a config.json, or a preset (see `tierlm init --help`)")
    q.add_argument("--task", choices=("finetune", "serve"), default="finetune")
    q.add_argument("--hardware", default="this",
                   help="'this' (measured), a system name, or parts joined by '+', e.g. rtx4090+256GiB+p5510*12")
    q.add_argument("--batch", type=int, default=1, help="sequences per step (finetune) or concurrent requests (serve)")
    q.add_argument("--seq-len", type=int, default=1024, help="training sequence length, or prompt length when serving")
    q.add_argument("--tokens", type=int, default=256, help="serve: tokens generated per request")
    q.add_argument("--weights", choices=("bf16", "int8", "int4"), default="bf16",
                   help="serve: the decoder layers' weight format, as `tierlm generate --weights` holds them")
    q.add_argument("--activations", choices=("auto", "keep", "swap", "recompute"), default="auto",
                   help="saved activations: auto (the fastest split), keep in RAM, swap to NVMe, recompute")
    q.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: bf16 on catalog hardware; on 'this', what `tierlm finetune` would measure and pick")
    q.add_argument("--cpu-mem", default=None, metavar="SIZE", help="RAM the run may use (default: the machine's less a reserve)")
    q.add_argument("--no-state-cache", action="store_true",
                   help="stream all optimizer state through the SSD even when RAM has room (today's engine)")
    q.add_argument("--clip", choices=("on", "off", "redo"), default="on",
                   help="gradient clipping: on (gradients saved for an exact redo), off, redo (every step clips)")
    q.add_argument("--compare", default=None, metavar="HW1,HW2,...|all", help="rank these options and chart them")
    q.add_argument("--chart", default=None, metavar="PNG", help="where --compare draws throughput vs cost")
    q.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
    q.add_argument("--catalog", default=None, metavar="TOML", help="your own parts: [gpu.NAME], [cpu.NAME], [drive.NAME], [system]")
    q.add_argument("--nvme", default=None, metavar="DIR", help="with --hardware this: the NVMe directory to measure")
    q.set_defaults(fn=_cmd_plan)

    q = sub.add_parser("bench", help="measure this machine (io, compute), or a training step in memory vs out-of-core")
    q.add_argument("what", choices=("io", "compute", "train"),
                   help="io: NVMe read/write and host memory; compute: matmul, a decoder layer, AdamW and the "
                        "engine's fixed costs per step and layer (on --nvme); train: MODEL in memory and "
                        "out-of-core side by side")
    q.add_argument("model", nargs="?", help="train: the model directory")
    q.add_argument("--data", help="train: the training data")
    q.add_argument("--cpu-mem", default="4GiB", help="train: the out-of-core run's budget")
    q.add_argument("--steps", type=int, default=5, help="train: steps of each run (the first two are warm-up: they create the state files)")
    q.add_argument("--work", default="runs/bench-train", help="train: where both runs write")
    q.add_argument("--finetune-args", default="", help="train: more finetune options for both runs, e.g. "
                                                      "'--seq-len 1024 --batch-size 4'")
    q.add_argument("--inmemory", choices=("auto", "always", "never"), default="auto",
                   help="train: run the in-memory reference where its estimate fits the RAM (auto), anyway "
                        "(always: it may be killed for memory), or not (never: compare with the I/O bound only)")
    q.add_argument("--nvme", default=".", metavar="DIR", help="directory on the drive to measure (io)")
    q.add_argument("--size", default="2GiB", help="bytes to write and read back (io)")
    q.set_defaults(fn=_cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    from .hf.presets import FAMILIES, NATIVE_PRESETS, PRESETS
    from .train.finetune import FinetuneConfig

    p = argparse.ArgumentParser(prog="tierlm", description=(
        "Fine-tune language models larger than memory: weights and optimizer states on NVMe, "
        "streamed layer by layer, an exact AdamW overlapped with backward."))
    sub = p.add_subparsers(dest="verb", required=True)

    q = sub.add_parser("init", help="create a random-initialised Hugging Face model directory")
    q.add_argument("out", help="directory to create")
    q.add_argument("--arch", metavar="FAMILY", help=f"model family, a small model unless --preset: "
                   f"{', '.join(FAMILIES)}, or any other decoder-only family transformers builds")
    q.add_argument("--preset", choices=sorted(PRESETS) + sorted(NATIVE_PRESETS),
                   help="the shapes of a published model")
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions"):
        q.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"override {name}")
    q.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--tokenizer-text", nargs="*", metavar="FILE",
                   help="train a BPE tokenizer on these text files (default: byte-level tokenizer)")
    q.add_argument("--overwrite", action="store_true", help="replace a model already in OUT")
    q.set_defaults(fn=_cmd_init)

    q = sub.add_parser("finetune", help="fine-tune every parameter out-of-core",
                       description="Fine-tune every parameter of MODEL with weights and optimizer "
                                   "states on NVMe under a RAM budget.")
    C.add_arguments(q, FinetuneConfig, positional=("model",))
    q.set_defaults(fn=_cmd_finetune)

    q = sub.add_parser("demo", help="create a small model, fine-tune it out-of-core under a tight budget, generate")
    q.add_argument("--dir", default="runs/demo", help="where the demo model, data and run go (default: runs/demo)")
    q.add_argument("--cpu-mem", default=None, help="the RAM budget (default: 160MiB in bf16, 256MiB in fp32)")
    q.add_argument("--steps", type=int, default=30, help="optimizer steps (default: 30)")
    q.set_defaults(fn=_cmd_demo)

    _add_infer_verbs(sub)
    _add_plan_verbs(sub)  # plan, bench
    from .validate import add_ranges_to_help
    add_ranges_to_help(sub.choices)  # `--help` says each number's range, from where it is checked
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        from .validate import check_args
        check_args(args.verb, args)  # every number in its range before the verb writes anything
        return args.fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        # Bad input: one clear line (the message names the input and the fix), exit code 2.
        print(f"tierlm {args.verb}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as e:
        from .storage import BudgetError, StorageError
        from .train.bench_train import RunFailed
        from .train.finetune import TrainingStopped
        if isinstance(e, (BudgetError, StorageError, TrainingStopped, RunFailed)):
            print(f"tierlm {args.verb}: error: {e}", file=sys.stderr)
            return EXIT_USAGE if isinstance(e, BudgetError) else 1
        raise


if __name__ == "__main__":
    sys.exit(main())
