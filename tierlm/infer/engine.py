"""The inference engine: an HF causal LM whose weights are resident when they fit, streamed when not.

No optimizer state and no master weights: the decoder layers that fit the `cpu` budget (beside the
embeddings, the head, the preallocated KV cache and the compute scratch) are read once from the
HF safetensors into RAM; the rest are written once to the NVMe store in their final form and
stream through a window of (prefetch + 1) layers. transformers' own modeling code runs each
forward, so attention, rotary embeddings and every architecture's details are theirs; a step
is one forward over every sequence in the batch, so each streamed layer is read once per step
whatever the batch size. Rows of different lengths (a prompt chunk beside decoding rows) run
packed, without padding (`packed.py`); the step through transformers' modules, and its check on a
small copy of the model at load, are `generic.py`; decode steps of the families tierlm's own
kernels cover run on `lean.py` (`describe()` says which path decodes, and why).

    eng = InferenceEngine("models/tiny", InferConfig(cpu_mem="2GiB", max_batch=4))
    logits = eng.step([[1, 2, 3], [7]], starts=[0, 0])   # rows are KV-cache slots 0 and 1
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import rss
from ..hf.baseline import library_baseline
from ..plan import budget as B
from ..hf.names import model_to_checkpoint
from ..storage import BudgetError, HostBufferPool
from ..storage.aligned import round_up
from ..units import fmt_bytes, parse_bytes
from . import packed as packed_attention
from .generic import GenericStep, check as generic_check
from .gemv import use_gemv
from .kvcache import SlotKVCache, kv_bytes
from .lean import LeanDecoder
from .quant import int4_layout
from .weights import LayerStream, PieceStore, fingerprint, install_resident, plan_pieces

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WEIGHTS = ("auto", "bf16", "fp32", "int8", "int4")


@dataclass
class InferConfig:
    cpu_mem: int | str = "4GiB"
    dtype: str = "bf16"              # compute dtype (and the KV cache's): bf16 | fp32
    weights: str = "auto"            # auto (the compute dtype) | bf16 | fp32 | int8 | int4
    nvme_dir: str | None = None      # the streamed layers' store; default: runs/infer-store/<model>
    max_batch: int = 1               # KV-cache slots: sequences decoded together
    max_seq_len: int | None = None   # positions per slot; default: the model's, at most 2048
    step_tokens: int = 256           # prompt tokens per forward (longer prompts prefill in chunks)
    prefetch: int = 2                # streamed layers read ahead of the one computing
    resident_layers: int | None = None  # None: as many as fit; fewer forces streaming
    io_threads: int = 4
    direct_io: bool | None = None
    threads: int | None = None       # compute threads (torch.set_num_threads); None: torch's default
    tp: int = 1                      # tensor-parallel processes (torchrun); this one holds 1/tp of each layer
    lean: bool = True                # decode steps of llama-family models on tierlm.infer.lean
    fused: bool = True               # ... each layer of them in one C call (tierlm.infer.fused)
    packed: bool = True              # rows of different lengths in one step run unpadded (infer.packed)

    def __post_init__(self):
        self.cpu_mem = parse_bytes(self.cpu_mem, "--cpu-mem")
        if self.weights in ("bf16", "fp32"):
            self.dtype = self.weights
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"--weights must be one of bf16, fp32, int8, int4, got {self.weights!r}")
        for name in ("max_batch", "step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.prefetch < 0:
            raise ValueError("--prefetch must be >= 0")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1 (processes sharing each layer), got {self.tp}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1 (compute threads), got {self.threads}")

    @property
    def quant(self) -> str | None:
        return self.weights if self.weights in ("int8", "int4") else None


@dataclass
class Placement:
    budget: int
    baseline: int
    fixed: int          # embeddings, final norm, head
    kv: int
    scratch: int
    layer_bytes: int    # the largest decoder layer
    layers: int
    resident: int       # decoder layers kept in RAM
    window: int         # stream window pool (0 when every layer is resident)

    @property
    def streamed(self) -> int:
        return self.layers - self.resident

    def describe(self) -> str:
        return (f"{self.resident}/{self.layers} layers resident, {self.streamed} streamed; budget "
                f"{fmt_bytes(self.budget)} = baseline {fmt_bytes(self.baseline)} + embeddings/head "
                f"{fmt_bytes(self.fixed)} + layers {fmt_bytes(self.resident * self.layer_bytes)} + stream window "
                f"{fmt_bytes(self.window)} + KV cache {fmt_bytes(self.kv)} + compute {fmt_bytes(self.scratch)}")


def scratch_bytes(config, cfg: InferConfig, max_len: int, dtype: torch.dtype, eager: bool = False,
                  packs: bool = True) -> int:
    """Transient memory of one forward of `step_tokens` tokens (an upper estimate): a layer's
    activations in fp32, attention scores over the whole cache, the logits, the kernels' caches,
    and the fused decode layer's buffers."""
    h = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    heads = config.num_attention_heads
    # a step feeds at most step_tokens of prompts beside one token of every other row; padded
    # (packed=False, or a model whose attention runs padded rows: packed.install), every row is as
    # long as the longest prompt chunk
    tokens = cfg.step_tokens + cfg.max_batch if cfg.packed and packs else cfg.step_tokens * cfg.max_batch
    act = tokens * (12 * h + 4 * inter) * 4
    if cfg.quant == "int4":  # a prefill dequantises one matrix to fp32 at a time
        act += 4 * inter * h
    scores = tokens * heads * (max_len + 1) * 4
    if eager:  # the model's eager attention (packed.py): the scores, soft-capped, their fp32 softmax, its cast
        scores *= 3
    logits = cfg.max_batch * config.vocab_size * 4 * 3
    # the fused decode layer's buffers (kernels/layer.c), kept between steps: a row's x, q/k/v,
    # attention, gate/up, silu and their integer roundings, and each thread's scores
    fused = cfg.max_batch * (7 * h + 4 * inter) * 4 + (os.cpu_count() or 1) * (max_len + 1) * 4
    return act + scores + logits + fused + B.RUNTIME_RESERVE


def plan_placement(cfg: InferConfig, baseline: int, fixed: int, layer_bytes: int, layers: int,
                   kv: int, scratch: int) -> Placement:
    avail = cfg.cpu_mem - baseline - fixed - kv - scratch
    want = cfg.resident_layers if cfg.resident_layers is not None else layers
    want = max(0, min(want, layers))
    if want == layers and layers * layer_bytes <= avail:
        return Placement(cfg.cpu_mem, baseline, fixed, kv, scratch, layer_bytes, layers, layers, 0)
    window = (cfg.prefetch + 1) * layer_bytes
    if avail < window:
        need = cfg.cpu_mem - avail + window
        raise BudgetError(
            f"--cpu-mem {fmt_bytes(cfg.cpu_mem)} cannot run this model: at least {fmt_bytes(need)} is needed "
            f"(process baseline {fmt_bytes(baseline)}, embeddings and head {fmt_bytes(fixed)}, KV cache "
            f"{fmt_bytes(kv)} for --max-batch {cfg.max_batch} x --max-seq-len, compute {fmt_bytes(scratch)}, "
            f"a stream window of {cfg.prefetch + 1} layers {fmt_bytes(window)}). Raise --cpu-mem to "
            f"{fmt_bytes(need * 1.05)}, or lower --max-batch / --max-seq-len / --step-tokens / --prefetch, "
            f"or use --weights int8 or int4")
    resident = min(want, max(0, (avail - window) // max(layer_bytes, 1)))
    return Placement(cfg.cpu_mem, baseline, fixed, kv, scratch, layer_bytes, layers, int(resident), window)


def _check_kv_attention(model, layers: int) -> None:
    """Refuse a model whose decoder layers do not all attend over a KV cache: the engine keeps one
    cache slot per layer and sequence, and nothing else (a state-space layer's recurrent state, an
    RNN's, has no place in it). A layer attends where it holds one of transformers' attention
    modules that knows its layer index (what it hands the cache's `update`)."""
    from ..hf.structure import find_layers

    _, mods = find_layers(model)
    without = [i for i, layer in enumerate(mods) if not packed_attention.attention_modules(layer)]
    if without:
        which = "its layers" if len(without) == layers else \
            f"its layers {', '.join(map(str, without[:8]))}{' ...' if len(without) > 8 else ''}"
        raise ValueError(
            f"{type(model).__name__}: {which} keep no KV cache (no attention module that knows its layer: "
            f"a state-space or recurrent model, such as Mamba or RWKV, or a hybrid of them); tierlm's "
            f"inference runs models whose every decoder layer is attention over a KV cache")


class InferenceEngine:
    def __init__(self, model_dir, cfg: InferConfig, library_rss: int | None = None):
        from transformers import AutoConfig

        from ..hf.structure import discover_blocks, empty_model
        from ..hf.checks import check_model_dir
        from ..hf.safetensors_io import SafetensorsDir

        check_model_dir(model_dir)
        self.model_dir, self.cfg = Path(model_dir), cfg
        self.dtype = DTYPES[cfg.dtype]
        config = AutoConfig.from_pretrained(model_dir)
        # built with the one implementation every model accepts (Gemma2 refuses SDPA: it cannot
        # soft-cap); packed.install then names the attention the steps run (masks: boolean, True
        # attends)
        config._attn_implementation = "eager"
        self.config = config
        limit = getattr(config, "max_position_embeddings", None) or 2048
        self.max_len = cfg.max_seq_len or min(limit, 2048)
        if self.max_len > limit:
            raise ValueError(f"--max-seq-len {self.max_len} exceeds the model's {limit} positions")
        self.model = empty_model(config).eval()
        # what the library baseline's warm-up forward runs until packed.install names the steps'
        config._attn_implementation = "sdpa" if getattr(self.model, "_supports_sdpa", False) else "eager"
        self.blocks, _ = discover_blocks(self.model)
        _check_kv_attention(self.model, sum(b.kind == "layer" for b in self.blocks))
        why = generic_check(self.model)
        if why:
            raise ValueError(f"{config.model_type} ({type(self.model).__name__}): tierlm's inference cannot run "
                             f"this model: {why}")
        self.tp = None
        if cfg.tp > 1:  # this process keeps 1/tp of every layer's heads and MLP width
            from ..dist.tp import TensorParallel, init
            self.tp = TensorParallel(*init(cfg.tp))
            self.tp.shard(self.model, [b.module for b in self.blocks if b.kind == "layer"], config)
        cache_config = self.tp.local_config(config) if self.tp else config
        # weights a token multiplies (2 FLOPs each): everything but the embedding lookup, plus the head
        total = sum(p.numel() for p in self.model.parameters())
        self.flop_params = total - self.model.get_input_embeddings().weight.numel() + \
            config.vocab_size * config.hidden_size
        self.pieces = plan_pieces(self.model, self.blocks, self.dtype, cfg.quant)
        tp_tag = f"-tp{self.tp.rank}of{self.tp.world}" if self.tp else ""
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if self.dtype == torch.bfloat16:
            use_gemv(self.model)  # after plan_pieces: the quantised linears are QLinear already
        layer_idx = [b.index for b in self.blocks if b.kind == "layer"]
        fixed = sum(round_up(p.nbytes) for b in self.blocks if b.kind != "layer" for p in self.pieces[b.index])
        lbytes = max(sum(round_up(p.nbytes) for p in self.pieces[i]) for i in layer_idx)

        rss.trim()
        self.library_rss = library_rss if library_rss is not None else library_baseline(config, self.dtype)
        baseline = max(rss.current_rss() - self.library_rss, 0)
        kv = kv_bytes(cache_config, cfg.max_batch, self.max_len, self.dtype)
        self.placement = plan_placement(cfg, baseline, fixed, lbytes, len(layer_idx), kv,
                                        scratch_bytes(config, cfg, self.max_len, self.dtype,
                                                      eager=not getattr(self.model, "_supports_sdpa", True),
                                                      packs=packed_attention.packs(self.model)))
        resident = set(layer_idx[: self.placement.resident])
        streamed = [i for i in layer_idx if i not in resident]

        st = SafetensorsDir(model_dir)
        in_file = model_to_checkpoint(self.model, st.names(), {n for b in self.blocks for n in b.uses},
                                      where=str(model_dir))

        def src(name: str) -> torch.Tensor:
            if name not in in_file:
                raise ValueError(f"{model_dir}: the checkpoint has no tensor {name!r} that "
                                 f"{type(self.model).__name__} needs; is this the right model directory?")
            t = st.read(in_file[name])
            return self.tp.read(name, t) if self.tp else t

        t0 = time.perf_counter()
        self.resident_bytes = 0
        for b in self.blocks:
            if b.kind != "layer" or b.index in resident:
                install_resident(self.pieces[b.index], src)
                self.resident_bytes += sum(p.nbytes for p in self.pieces[b.index])
        self.store = self.stream = None
        self.store_written = 0
        if streamed:
            root = Path(cfg.nvme_dir or Path("runs") / "infer-store" / f"{self.model_dir.name}-{cfg.weights}-{cfg.dtype}")
            if self.tp:  # each shard streams its own slices
                root = root / tp_tag[1:]
            self.pool = HostBufferPool(self.placement.window, name="layer stream window")
            layout = f"-{int4_layout()}" if cfg.quant == "int4" else ""
            self.store = PieceStore(root, self.pool, fingerprint(self.model_dir, self.dtype, f"{cfg.quant}{layout}{tp_tag}"),
                                    cfg.io_threads, cfg.direct_io)
            for i in streamed:
                for p in self.pieces[i]:
                    p.install(None)
                self.store_written += self.store.ensure(self.pieces[i], src)
            self.stream = LayerStream(self.store.store, self.pool, {i: self.pieces[i] for i in streamed},
                                      cfg.prefetch)
            by_index = {b.index: b for b in self.blocks}
            for i in streamed:
                mod = by_index[i].module
                mod.register_forward_pre_hook(lambda m, a, i=i: self.stream.acquire(i))
                mod.register_forward_hook(lambda m, a, o, i=i: self.stream.release(i))
        st.close()
        self.load_s = time.perf_counter() - t0
        self.streamed_bytes = sum(self.stream.layer_bytes.values()) if self.stream else 0
        self.cache = SlotKVCache(cache_config, cfg.max_batch, self.max_len, self.dtype)
        self.generic = GenericStep(self.model, config, self.cache, packed=cfg.packed)
        self.base, self.head = self.generic.base, self.generic.head
        self._window, self._sliding = self.generic.window, self.generic.sliding
        self.lean = LeanDecoder.build(self) if cfg.lean else None
        rss.trim()

    # ---- compute ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Row b appends tokens[b] to KV slot b (which holds starts[b] positions); returns the
        fp32 logits of each row's last token, [rows, vocab]."""
        if self.tp:
            self.tp.lead_step(tokens, starts)  # rank 0 tells the other shards what to compute
        ids, pos, mask, packed = self.generic.prepare(tokens, starts)
        if self.stream:
            self.stream.prefetch_after(None)
        if ids.shape[1] == 1 and self.lean is not None:
            return self.lean.logits(ids, pos, mask, self.cache)
        return self.generic.logits(ids, pos, mask, packed, [len(t) for t in tokens])

    @torch.no_grad()
    def logits_all(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of [B, T] ids without the cache (perplexity)."""
        return self.generic.logits_all(input_ids)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if self.tp:
            self.tp.lead_move(src, dst, length)
        self.cache.move(src, dst, length)

    def reinstall(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Install `tensors` (piece key -> a tensor of the installed one's dtype and shape) in place
        of resident pieces; returns the ones they replace. For benchmarks that compare where the
        same weights lie (benchmarks/infer_bench.py --layout)."""
        old = {}
        for b in self.blocks:
            if self.stream and b.index in self.stream.layer_bytes:
                continue
            for p in self.pieces[b.index]:
                if p.key in tensors:
                    cur, new = p.installed(), tensors[p.key]
                    if new.dtype != cur.dtype or new.shape != cur.shape:
                        raise ValueError(f"{p.key}: {new.dtype} {tuple(new.shape)} cannot replace "
                                         f"{cur.dtype} {tuple(cur.shape)}")
                    old[p.key] = cur
                    p.install(new)
        for f in (self.lean.fused or []) if self.lean else []:
            f.weights_moved()
        return old

    # ---- what a step moves, for the report ----------------------------------------------
    def ram_weight_bytes(self) -> int:
        """Weight bytes a forward reads from RAM (resident layers and the head; the embedding
        lookup reads a few rows)."""
        emb = sum(p.nbytes for p in self.pieces[self.blocks[0].index])
        return self.resident_bytes - emb + (self.streamed_bytes if self.stream else 0)

    def ssd_bytes_read(self) -> int:
        return self.store.store.stats.snapshot()["bytes_read"] if self.store else 0

    def decode_path(self) -> str:
        """Which code runs a decode step, and why not tierlm's own where it does not."""
        if self.lean is not None:
            if self.lean.fused is not None:
                return "decode: native (tierlm's fused kernels)"
            return "decode: native (tierlm's lean decoder, a kernel call per product)"
        if not self.cfg.lean:
            why = "the native path is switched off (lean=False)"
        else:
            refusal = getattr(LeanDecoder, "refusal", None)
            why = refusal(self) if refusal is not None else None
            why = why or f"tierlm's native decoder does not cover {self.config.model_type}"
        return f"decode: generic (transformers' modules: {why})"

    def describe(self) -> str:
        w = self.cfg.quant or self.cfg.dtype
        tp = f"tensor-parallel rank {self.tp.rank} of {self.tp.world} (1/{self.tp.world} of each layer); " \
            if self.tp else ""
        return f"{self.config.model_type}, weights {w}: {tp}{self.placement.describe()}; {self.decode_path()}"

    def close(self) -> None:
        if self.tp:
            self.tp.lead_stop()
            self.tp.shutdown()
            self.tp = None
        if self.stream:
            self.stream.close()
        if self.store:
            self.store.close()
