"""The flags `tierlm generate`, `chat` and `serve` share: argparse alone, so that building the
command line (and `--help`) imports neither torch nor the engine."""
from __future__ import annotations


def add_engine_args(q, max_batch: int | None = None) -> None:
    q.add_argument("model", help="a Hugging Face model directory (config.json, *.safetensors, tokenizer)")
    q.add_argument("--cpu-mem", default="4GiB", help="RAM this process may use beyond the libraries "
                   "(weights that fit stay resident, the rest stream from --nvme; default: 4GiB)")
    q.add_argument("--weights", default="bf16", choices=("bf16", "fp32", "int8", "int4"),
                   help="weight format, chosen at load time (default: bf16)")
    q.add_argument("--dtype", default=None, choices=("bf16", "fp32"),
                   help="compute and KV-cache dtype (default: fp32 for --weights fp32, else bf16)")
    q.add_argument("--nvme", default=None, help="directory of the streamed layers' store (written once; "
                   "default: runs/infer-store/<model>-<weights>)")
    q.add_argument("--max-seq-len", type=int, default=None, help="positions per KV-cache slot")
    if max_batch is not None:
        q.add_argument("--max-batch", type=int, default=max_batch,
                       help=f"sequences decoded together (KV-cache slots; default: {max_batch})")
    q.add_argument("--step-tokens", type=int, default=256, help="prompt tokens per forward (default: 256)")
    q.add_argument("--prefetch", type=int, default=2, help="streamed layers read ahead (default: 2)")
    q.add_argument("--resident-layers", type=int, default=None,
                   help="keep at most this many decoder layers in RAM (default: as many as fit)")
    q.add_argument("--tp", type=int, default=1, help="tensor-parallel processes sharing each layer (run under "
                   "`torchrun --nproc-per-node N`; rank 0 prints and serves; default: 1)")
    q.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: torch's, one per core; 1 can be faster on a busy machine)")


def add_sampling_args(q, max_tokens: int = 128) -> None:
    q.add_argument("--max-new-tokens", type=int, default=max_tokens, help=f"(default: {max_tokens})")
    q.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    q.add_argument("--top-p", type=float, default=1.0)
    q.add_argument("--top-k", type=int, default=0)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
