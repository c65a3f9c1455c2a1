"""The options of `tierlm generate`, `chat` and `serve`, one typed config per verb.

Each config is the verb's flags, the keys of its `--config FILE` and the values its report logs
(tierlm/config.py builds the parser from the fields; flags override the file). RANGES are checked
as the config is built, before anything is loaded or written. This module imports no torch:
building the command line and `--help` answer at once (tests/test_cli.py checks).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import validate as V
from ..config import option

WEIGHTS = ("bf16", "fp32", "int8", "int4")
DTYPES = ("bf16", "fp32")


@dataclass(kw_only=True)
class EngineOptions:
    """How the model is held and run: what every inference verb takes."""
    model: str = option(help="a Hugging Face model directory (config.json, *.safetensors, tokenizer)")
    cpu_mem: str = option("4GiB", help="RAM this process may use beyond the libraries (weights that fit stay "
                                       "resident, the rest stream from --nvme)")
    weights: str = option("bf16", choices=WEIGHTS, help="weight format, chosen at load time")
    dtype: str | None = option(None, choices=DTYPES, help="compute and KV-cache dtype "
                                                          "(default: fp32 for --weights fp32, else bf16)")
    device: str = option("auto", help="where layers compute: cpu, cuda (cuda:N), or auto: the GPU where PyTorch "
                                      "sees one (layers that do not fit --gpu-mem are copied from host memory "
                                      "each step)")
    gpu_mem: str | None = option(None, metavar="SIZE", help="GPU memory the run may use (default: 90%% of what "
                                                            "is free at start; ignored on the CPU)")
    nvme: str | None = option(None, help="directory of the streamed layers' store (written once; "
                                         "default: runs/infer-store/<model>-<weights>)")
    max_seq_len: int | None = option(None, help="positions per KV-cache slot")
    step_tokens: int = option(256, help="prompt tokens per forward")
    prefetch: int = option(2, help="streamed layers read ahead")
    expert_cache: str = option("lfu", choices=("lfu", "lru"),
                               help="a mixture of experts that does not fit: which streamed experts the expert "
                                    "cache keeps (lfu: the most often routed to, lru: the most recently)")
    resident_layers: int | None = option(None, help="keep at most this many decoder layers in RAM "
                                                    "(default: as many as fit)")
    tp: int = option(1, help="tensor-parallel processes sharing each layer (run under "
                             "`torchrun --nproc-per-node N`; rank 0 prints and serves)")
    threads: int | None = option(None, help="compute threads (default: torch's, one per core; 1 can be "
                                            "faster on a busy machine)")


@dataclass(kw_only=True)
class SamplingOptions:
    """How the next token is chosen and when a completion ends (tierlm.infer.sampling)."""
    max_new_tokens: int = option(128, help="tokens to generate at most")
    temperature: float = option(0.0, help="the logits are divided by it before sampling")
    top_p: float = option(1.0, help="sample from the smallest set of tokens whose probability reaches this")
    top_k: int = option(0, help="sample from the k most likely tokens")
    seed: int = option(0, help="the sampler's seed")
    stop: list[str] = option(default_factory=list, help="stop string")


@dataclass(kw_only=True)
class GenerateConfig(SamplingOptions, EngineOptions):
    """`tierlm generate`: one prompt, its completion and the phase report."""
    prompt: str = option(help="the prompt text")
    chat: bool = option(False, help="wrap the prompt in the model's chat template")
    batch: int = option(1, help="decode this many copies together (throughput)")
    ignore_eos: bool = option(False, help="always generate --max-new-tokens (benchmarks)")
    json: str | None = option(None, metavar="FILE", help="also write the report to FILE")
    RANGES = V.GENERATE


@dataclass(kw_only=True)
class ChatConfig(SamplingOptions, EngineOptions):
    """`tierlm chat`: a conversation on the terminal."""
    max_new_tokens: int = option(256, help="tokens to generate at most, a turn")
    system: str | None = option(None, help="a system message")
    RANGES = V.CHAT


@dataclass(kw_only=True)
class ServeConfig(EngineOptions):
    """`tierlm serve`: an OpenAI-compatible HTTP server; each request brings its own sampling."""
    max_batch: int = option(8, help="sequences decoded together (KV-cache slots)")
    host: str = option("127.0.0.1", help="address to listen on")
    port: int = option(8000, help="the port to listen on")
    served_model_name: str | None = option(None, help="the model id clients use (default: the directory's name)")
    RANGES = V.SERVE
