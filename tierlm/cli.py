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
    from .hf.init_options import InitConfig
    from .hf.presets import make_config, param_count
    from .units import fmt_bytes

    cfg = C.from_args(InitConfig, args)
    config = make_config(cfg.arch, cfg.preset, cfg.overrides())
    out = init_model(cfg.out, config, seed=cfg.seed, tokenizer_text=cfg.tokenizer_text or None,
                     overwrite=cfg.overwrite)
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
    from .demo import DemoConfig, run_demo

    run_demo(C.from_args(DemoConfig, args))
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
    from .advise.options import PlanConfig

    cfg = C.from_args(PlanConfig, args)
    plans = run_plan(cfg)
    return 0 if cfg.compare or plans[0].fits else 1


def _cmd_bench(args) -> int:
    from .advise.options import BenchConfig
    from .units import parse_bytes

    cfg = C.from_args(BenchConfig, args)
    if cfg.what == "train":
        import shlex

        from .train.bench_train import bench_train, report
        if not cfg.model or not cfg.data:
            raise ValueError("bench train needs MODEL and --data FILE")
        r = bench_train(cfg.model, cfg.data, cfg.cpu_mem, cfg.steps, cfg.work,
                        shlex.split(cfg.finetune_args or ""), nvme=None if cfg.nvme == "." else cfg.nvme,
                        inmemory=cfg.inmemory, peers=cfg.peers)
        print(report(r))
        return 0
    from .advise.command import bench_text, run_bench
    res = run_bench(cfg.what, cfg.nvme, size=parse_bytes(cfg.size, "--size"))
    print(bench_text(cfg.what, res))
    return 0


def _add_plan_verbs(sub) -> None:
    from .advise.options import BenchConfig, PlanConfig

    q = sub.add_parser("plan", help="which hardware, which placement, how fast, at what cost",
                       description="Plan fine-tuning or serving MODEL on HARDWARE: placement per tier, each "
                                   "resource's time and the binding one, throughput, cost per million tokens.")
    C.add_arguments(q, PlanConfig, positional=("model",))
    q.set_defaults(fn=_cmd_plan)

    q = sub.add_parser("bench", help="measure this machine (io, compute), or a training step in memory vs out-of-core")
    C.add_arguments(q, BenchConfig, positional=("what", "model"))
    q.set_defaults(fn=_cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    from .demo import DemoConfig
    from .hf.init_options import InitConfig
    from .train.options import FinetuneConfig

    p = argparse.ArgumentParser(prog="tierlm", description=(
        "Fine-tune language models larger than memory: weights and optimizer states on NVMe, "
        "streamed layer by layer, an exact AdamW overlapped with backward."))
    sub = p.add_subparsers(dest="verb", required=True)

    q = sub.add_parser("init", help="create a random-initialised Hugging Face model directory")
    C.add_arguments(q, InitConfig, positional=("out",))
    q.set_defaults(fn=_cmd_init)

    q = sub.add_parser("finetune", help="fine-tune every parameter out-of-core",
                       description="Fine-tune every parameter of MODEL with weights and optimizer "
                                   "states on NVMe under a RAM budget.")
    C.add_arguments(q, FinetuneConfig, positional=("model",))
    q.set_defaults(fn=_cmd_finetune)

    q = sub.add_parser("demo", help="create a small model, fine-tune it out-of-core under a tight budget, generate")
    C.add_arguments(q, DemoConfig)
    q.set_defaults(fn=_cmd_demo)

    _add_infer_verbs(sub)
    _add_plan_verbs(sub)  # plan, bench
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)  # each verb's config checks every number's range before it writes anything
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
        from .serve.run import GenerationFailed
        if isinstance(e, (BudgetError, StorageError, TrainingStopped, RunFailed, GenerationFailed)):
            print(f"tierlm {args.verb}: error: {e}", file=sys.stderr)
            return EXIT_USAGE if isinstance(e, BudgetError) else 1
        raise


if __name__ == "__main__":
    sys.exit(main())
