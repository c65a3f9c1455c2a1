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

import time
from pathlib import Path

import torch

from .. import rss
from ..dist.tp import TensorParallel, init
from ..heap import HeapGuard
from ..hf import checks, fields  # checks called through the module: tests replace them
from ..hf.baseline import library_baseline
from ..hf.device import move_buffers, resolve_device
from ..hf.names import load_buffers, model_to_checkpoint
from ..hf.stacked import read_param
from ..hf.safetensors_io import SafetensorsDir
from ..hf.structure import discover_blocks, empty_model, find_layers
from ..plan.expert_placement import plan_expert_placement
from ..plan.inference import InferConfig, cache_name, plan_placement, scratch_bytes
from ..storage import BudgetError, HostBufferPool
from ..storage.aligned import round_up
from . import packed as packed_attention
from .gemv import use_gemv
from . import states
from .generic import GenericStep, check as generic_check, continues_prompts, engine_failure, mask_mode, reads_offset
from .device_run import DeviceRun, refusal as device_refusal
from .kvcache import SlotKVCache, kv_bytes
from .model_cache import ModelCaches, slot_bytes
from .states import StateShape, StateSlots
from .lean import LeanDecoder
from .quant import int4_layout
from .expert_rows import use_expert_rows
from .experts import (ExpertCache, RoutedCount, StreamedExperts, expert_key, expert_parts, find_moe, quantizers,
                      unrouted_params, write_experts)
from .weights import LayerStream, PieceStore, fingerprint, install_resident, plan_pieces

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
HEAP_MIN_SHARE = 32 << 20


def _check_kv_attention(model, layers: int, shapes: list[StateShape] | None) -> None:
    """Refuse a model with a decoder layer that keeps neither a KV cache nor states the cache holds
    (states.py): the engine keeps a cache slot per layer and sequence for keys and values, and for
    the conv and recurrent states transformers' state-space and linear-attention layers store
    through the cache; an RNN that carries its own state object (RWKV) has no place in it. A layer
    attends where it holds one of transformers' attention modules that knows its layer index (what
    it hands the cache's `update`). Where some layers keep states, others may keep nothing at all
    (an MLP-only layer); the load-time check on a small copy (generic.check) sees the rest."""

    if shapes:  # beside layers that keep states, a layer may keep nothing (Nemotron-H's MLP-only layers)
        return
    _, mods = find_layers(model)
    without = [i for i, layer in enumerate(mods) if not packed_attention.attention_modules(layer)]
    if without:
        which = "its layers" if len(without) == layers else \
            f"its layers {', '.join(map(str, without[:8]))}{' ...' if len(without) > 8 else ''}"
        raise ValueError(
            f"{type(model).__name__}: {which} keep no KV cache (no attention module that knows its layer) and no "
            f"state through transformers' cache (a recurrent model with a state of its own, such as RWKV); "
            f"tierlm's inference runs models whose layers attend over a KV cache or keep transformers' "
            f"conv and recurrent states (Mamba, Qwen3-Next and the other hybrids)")


class InferenceEngine:
    def __init__(self, model_dir, cfg: InferConfig, library_rss: int | None = None):
        checks.check_model_dir(model_dir)
        self.model_dir, self.cfg = Path(model_dir), cfg
        self.dtype = DTYPES[cfg.dtype]
        self.device = resolve_device(cfg.device)
        config = self._build_model(model_dir)
        # layers on a GPU (or the CPU through the same schedule): tierlm.infer.device_run
        self.dev = DeviceRun(self.device, cfg) if self.device.type != "cpu" or cfg.device_schedule else None
        why = device_refusal(self.device, self) if self.dev else None
        if why:
            raise ValueError(why)
        cache_config = self.tp.local_config(config) if self.tp else config
        # weights a token multiplies (2 FLOPs each): everything but the embedding lookup, plus the head
        total = sum(p.numel() for p in self.model.parameters())
        self.flop_params = total - self.model.get_input_embeddings().weight.numel() + \
            config.vocab_size * config.hidden_size - unrouted_params(self.moe, config)
        self.pieces = plan_pieces(self.model, self.blocks, self.dtype, cfg.quant)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            use_gemv(self.model)  # after plan_pieces: the quantised linears are QLinear already
        resident, streamed = self._place(cache_config, library_rss)
        self._load_weights(model_dir, resident, streamed)
        masks = mask_mode(self.model)
        # where the model keeps what the slot cache does not hold, each slot holds the model's own
        self.cache = ModelCaches(cfg.max_batch, self.max_len, self.own_cache_bytes) if masks == "cache" else \
            SlotKVCache(cache_config, cfg.max_batch, self.max_len, self.dtype, device=self.device,
                        states=self.state_shapes, kv_layers=self.kv_layers)
        self.generic = GenericStep(self.model, config, self.cache, packed=cfg.packed, masks=masks)
        self.base, self.head = self.generic.base, self.generic.head
        self._window, self._sliding = self.generic.window, self.generic.sliding
        # tierlm's native kernels are CPU code; the device schedule runs transformers' modules
        # (nor where the model makes its own masks: the native path attends with the engine's)
        self.lean = LeanDecoder.build(self) if cfg.lean and not self.dev and self.generic.masks == "engine" else None
        rss.trim()
        self.heap = self._heap_guard()

    def _heap_guard(self) -> HeapGuard:
        """Freed heap blocks kept for reuse by the next layer's tensors (tierlm/heap.py), checked before
        each decoder layer: past the budget less the compute share (what one layer's forward may add
        before the next check) they go back to the OS. tierlm's import settings give every tensor
        over 64 KiB fresh pages, zeroed by the kernel on first touch: a 512-token prefill of
        TinyLlama-1.1B faulted its every activation, products' outputs included, in again at each of
        its 22 layers. On a GPU the host keeps only the step's inputs and logits: no guard."""
        if self.dev:
            return HeapGuard(0, 0, min_share=1)  # closed
        scratch = self.placement.scratch
        guard = HeapGuard(self.library_rss + self.cfg.cpu_mem - scratch, scratch, min_share=HEAP_MIN_SHARE,
                          keep_top=True)
        if guard.open:
            for b in self.blocks:
                if b.kind == "layer":
                    b.module.register_forward_pre_hook(self._check_heap)
        return guard

    def _check_heap(self, module, args) -> None:
        self.heap.check()  # a pre-hook's result would replace the layer's arguments: none

    def _build_model(self, model_dir):
        """The model on `meta`, checked for what the engine can run, and this process's share of it
        under tensor parallelism; returns its config."""
        from transformers import AutoConfig

        cfg = self.cfg
        config = AutoConfig.from_pretrained(model_dir)
        # built with the one implementation every model accepts (Gemma2 refuses SDPA: it cannot
        # soft-cap); packed.install then names the attention the steps run (masks: boolean, True
        # attends)
        config._attn_implementation = "eager"
        # a mixture of experts' router logits feed training's load-balancing loss only; recorded at
        # inference they would be made into that loss over the KV cache's masks
        if getattr(config, "output_router_logits", False):
            config.output_router_logits = False
        self.config = config
        limit = fields.get(config, "max_positions") or 2048  # (MPT: max_seq_len, its ALiBi's length)
        self.max_len = cfg.max_seq_len or min(limit, 2048)
        if self.max_len > limit:
            raise ValueError(f"--max-seq-len {self.max_len} exceeds the model's {limit} positions")
        self.model = empty_model(config, self.dtype).eval()
        use_expert_rows(self.model)  # a mixture of experts' experts: only the routed ones, on our kernels
        # what the library baseline's warm-up forward runs until packed.install names the steps'
        config._attn_implementation = "sdpa" if getattr(self.model, "_supports_sdpa", False) else "eager"
        self.blocks, _ = discover_blocks(self.model)
        self.moe = find_moe(self.model, self.blocks)
        # recurrent layers' states, sized by the model's own forward on meta (states.py)
        self.state_shapes = states.probe(config, bool(packed_attention.attention_modules(self.model))) \
            if states.keeps_states(self.model) else None
        _check_kv_attention(self.model, sum(b.kind == "layer" for b in self.blocks), self.state_shapes)
        # beside recurrent layers, keys and values only for the layers that attend (Qwen3-Next: 1 in 4)
        self.kv_layers = states.kv_layers(packed_attention.attention_modules(self.model), config) \
            if self.state_shapes else None
        why = generic_check(self.model)
        if why:
            raise ValueError(f"{config.model_type} ({type(self.model).__name__}): tierlm's inference cannot run "
                             f"this model: {why}")
        # where a recurrent layer cannot continue a prompt from its kept state, or the model's own cache
        # a prompt's later chunk (MiniMax's masks read the length of its first layer's cache, a
        # lightning layer's, which keeps no keys), each prompt is one step
        self.whole_prompts = (bool(self.state_shapes) or mask_mode(self.model) == "cache") and \
            not continues_prompts(self.model)
        self.tp = None
        if cfg.tp > 1:  # this process keeps 1/tp of every layer's heads and MLP width
            if self.moe:
                raise ValueError(f"{config.model_type}: --tp does not split a mixture of experts' experts; "
                                 "run it with --tp 1 (its experts stream through the expert cache)")
            if self.state_shapes:
                raise ValueError(f"{config.model_type}: --tp does not split the recurrent layers' states; "
                                 "run it with --tp 1")
            self.tp = TensorParallel(*init(cfg.tp))
            self.tp.shard(self.model, [b.module for b in self.blocks if b.kind == "layer"], config)
        return config

    def _place(self, cache_config, library_rss: int | None) -> tuple[set[int], list[int]]:
        """Which decoder layers stay in RAM under --cpu-mem (tierlm.plan.inference.plan_placement,
        as `tierlm plan` predicts it): the resident layers' indices and the streamed ones'. A
        mixture of experts that does not fit whole streams its experts through an expert cache
        (tierlm.plan.expert_placement); then these are the layers whose dense parts are resident."""
        cfg, config = self.cfg, self.config
        layer_idx = [b.index for b in self.blocks if b.kind == "layer"]
        fixed = sum(round_up(p.nbytes) for b in self.blocks if b.kind != "layer" for p in self.pieces[b.index])
        lbytes = max(sum(round_up(p.nbytes) for p in self.pieces[i]) for i in layer_idx)
        rss.trim()
        self.library_rss = library_rss if library_rss is not None else library_baseline(config, self.dtype)
        baseline = max(rss.current_rss() - self.library_rss, 0)
        self.own_cache_bytes = None
        if mask_mode(self.model) == "cache":  # a slot holds the model's own cache: its bytes measured
            self.own_cache_bytes = slot_bytes(cache_config, self.max_len, self.dtype)
            kv, kv_name = cfg.max_batch * self.own_cache_bytes, "the model's own cache"
        else:
            kv = kv_bytes(cache_config, cfg.max_batch, self.max_len, self.dtype, self.kv_layers)
            held = StateSlots.bytes_for(self.state_shapes, cfg.max_batch, self.dtype) if self.state_shapes else 0
            kv_name = cache_name(kv, held)
            kv += held
        # a recurrent model's step runs its rows in groups of one length (generic.row_groups): a
        # forward holds at most one prompt chunk's tokens, or the decoding rows' - as a packed one
        # does - except where prompts go whole (then several of one length may share a forward)
        # (on the model's own caches, a forward is one row's: at most a prompt chunk's tokens, as packed)
        packs = not self.whole_prompts if self.state_shapes else mask_mode(self.model) == "cache" or \
            packed_attention.packs(self.model) and not reads_offset(self.model) and mask_mode(self.model) == "engine"
        scratch = scratch_bytes(config, cfg, self.max_len, self.dtype,
                                eager=packed_attention.runs_eager(self.model), packs=packs)
        if self.state_shapes:
            tokens = cfg.step_tokens * (cfg.max_batch if self.whole_prompts else 1)
            scratch += StateSlots.transient_bytes(self.state_shapes, tokens, cfg.max_batch)
        self.experts = self.expert_placement = None
        if self.dev:  # the device under --gpu-mem, then the host under --cpu-mem
            self.placement, resident, streamed = self.dev.place(baseline, fixed, lbytes, layer_idx, kv, scratch,
                                                                kv_name)
            return resident, streamed
        try:
            self.placement = plan_placement(cfg, baseline, fixed, lbytes, len(layer_idx), kv, scratch, kv_name)
        except BudgetError:
            if not self.moe:  # a mixture of experts needs no window of whole layers: its experts stream
                raise
            self.placement = None
        # quantised experts are stored and cached an expert at a time whether or not they fit
        if self.moe and (cfg.quant or self.placement is None or self.placement.resident < len(layer_idx)):
            self.experts = self._expert_pieces()
            dense = max(sum(round_up(p.nbytes) for p in self.pieces[i]) for i in layer_idx)
            self.expert_placement = plan_expert_placement(
                cfg, baseline, fixed, dense, len(layer_idx), kv, scratch,
                (self.expert_slot, max(m.experts for m in self.moe.values()), len(self.moe)), kv_name)
            self.placement = self.expert_placement.placement
        resident = set(layer_idx[: self.placement.resident])
        return resident, [i for i in layer_idx if i not in resident]

    def _expert_pieces(self) -> dict[int, list]:
        """Take each layer's stacked expert parameters out of its pieces (layer -> those pieces),
        and size one expert's cache slot from the tensors an expert is stored as."""
        out = {}
        for i, moe in self.moe.items():
            names = set(moe.names())
            out[i] = [p for p in self.pieces[i] if p.key in names]
            self.pieces[i] = [p for p in self.pieces[i] if p.key not in names]
        _, mod, attrs = next(iter(self.moe.values())).modules[0]
        self.expert_quant = quantizers(mod, attrs, self.cfg.quant)
        self.expert_parts = expert_parts(mod, attrs, self.dtype, self.cfg.quant)
        self.expert_slot = sum(round_up(p.nbytes) for p in self.expert_parts)
        return out

    def _load_weights(self, model_dir, resident: set[int], streamed: list[int]) -> None:
        """The resident blocks' weights read into RAM, the streamed layers' written once to the store
        in their final form, each read from the checkpoint by the model's own names."""
        st = SafetensorsDir(model_dir)
        in_file = model_to_checkpoint(self.model, st.names(), {n for b in self.blocks for n in b.uses},
                                      where=str(model_dir))
        load_buffers(self.model, st, str(model_dir))
        move_buffers(self.model, self.device)

        def src(name: str) -> torch.Tensor:
            if name not in in_file:
                raise ValueError(f"{model_dir}: the checkpoint has no tensor {name!r} that "
                                 f"{type(self.model).__name__} needs; is this the right model directory?")
            t = read_param(st, in_file[name])
            return self.tp.read(name, t) if self.tp else t

        t0 = time.perf_counter()
        self.resident_bytes = 0
        for b in self.blocks:
            if b.kind != "layer" or b.index in resident:
                keep = self.dev is not None and b.kind == "layer" and b.index in self.dev.in_ram
                buf = install_resident(self.pieces[b.index], src, pin=keep and self.dev.pin)
                if self.dev:
                    self.dev.placed(b.index, self.pieces[b.index], b.kind == "layer", buf)
                self.resident_bytes += sum(p.nbytes for p in self.pieces[b.index])
        self.store = self.stream = self.streamed_experts = None
        self.store_written = 0
        if streamed or self.experts:
            self._open_store()
        if streamed:
            self._stream(streamed, src)
        if self.experts:
            self._stream_experts(in_file, st)
        # resident experts: a step reads those it routes to (counted), not all of them
        self.routed_count = RoutedCount(self.moe) if self.moe and not self.experts else None
        names = {n for m in self.moe.values() for n in m.names()} if self.routed_count else set()
        self.resident_expert_bytes = sum(p.nbytes for i in self.moe for p in self.pieces[i] if p.key in names)
        st.close()
        if self.dev:
            self.dev.attach({b.index: b.module for b in self.blocks}, self.pieces, self.stream)
        self.load_s = time.perf_counter() - t0
        self.streamed_bytes = sum(self.stream.layer_bytes.values()) if self.stream else 0

    def _stream_experts(self, in_file, st) -> None:
        """The experts of every layer with experts: in the store an expert at a time (quantised with
        --weights int8/int4), read into the expert cache when routed to (tierlm.infer.experts)."""
        self.store_written += write_experts(self.store, self.moe, self.expert_parts, self.expert_quant, in_file,
                                            st, self.dtype)
        names = {(i, a): f"{q}.{a}" for i, moe in self.moe.items() for q, _, attrs in moe.modules for a in attrs}
        cache = ExpertCache(self.store.store, lambda i, p, e: expert_key(names[(i, p.attr)], e) + p.suffix,
                            self.expert_parts, self.expert_placement.cache,
                            max(m.experts for m in self.moe.values()), policy=self.cfg.expert_policy)
        self.streamed_experts = StreamedExperts(cache, {i: self.moe[i].modules for i in self.experts},
                                                self.expert_quant)

    def _open_store(self) -> None:
        cfg = self.cfg
        tp_tag = f"-tp{self.tp.rank}of{self.tp.world}" if self.tp else ""
        root = Path(cfg.nvme_dir or Path("runs") / "infer-store" / f"{self.model_dir.name}-{cfg.weights}-{cfg.dtype}")
        if self.tp:  # each shard streams its own slices
            root = root / tp_tag[1:]
        pin = bool(self.dev and self.dev.pin)  # pinned where a GPU copies from it
        self.pool = HostBufferPool(self.placement.window, pin=pin, name="layer stream window")
        layout = f"-{int4_layout()}" if cfg.quant == "int4" else ""
        self.store = PieceStore(root, self.pool, fingerprint(self.model_dir, self.dtype, f"{cfg.quant}{layout}{tp_tag}"),
                                cfg.io_threads, cfg.direct_io)

    def _stream(self, streamed: list[int], src) -> None:
        """The streamed layers: in the store (written where it does not hold them already), read
        through a window of prefetch + 1 layers around each one's forward."""
        for i in streamed:
            for p in self.pieces[i]:
                p.install(None)
            self.store_written += self.store.ensure(self.pieces[i], src)
        prefetch = self.dev.host_config().prefetch if self.dev else self.cfg.prefetch
        self.stream = LayerStream(self.store.store, self.pool, {i: self.pieces[i] for i in streamed}, prefetch)
        if self.dev:  # the device schedule takes the layers from the window (DeviceRun.attach)
            return
        by_index = {b.index: b for b in self.blocks}
        for i in streamed:
            mod = by_index[i].module
            mod.register_forward_pre_hook(lambda m, a, i=i: self.stream.acquire(i))
            mod.register_forward_hook(lambda m, a, o, i=i: self.stream.release(i))

    # ---- compute ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Row b appends tokens[b] to KV slot b (which holds starts[b] positions); returns the
        fp32 logits of each row's last token, [rows, vocab]."""
        if self.tp:
            self.tp.lead_step(tokens, starts)  # rank 0 tells the other shards what to compute
        out = [self._step(tokens[a:b], starts[a:b], a) for a, b in self.generic.groups(tokens, starts)]
        return torch.cat(out) if len(out) > 1 else out[0]

    def _step(self, tokens: list[list[int]], starts: list[int], first: int) -> torch.Tensor:
        """One forward of rows in slots first, first + 1, ... (all of a step's, except where
        recurrent layers need rows of one length, or the attention one start: generic.row_groups)."""
        ids, pos, mask, packed = self.generic.prepare(tokens, starts, first)
        if self.stream:
            self.stream.prefetch_after(None)
        if ids.shape[1] == 1 and self.lean is not None and first == 0:  # the lean path reads slots from 0
            return self.lean.logits(ids, pos, mask, self.cache)
        if self.dev:
            self.dev.start_step()
            ids, pos, mask = _to(ids, self.device), _to(pos, self.device), _to(mask, self.device)
        # the logits to the host for the sampler (on the CPU: the same tensor)
        return self.generic.logits(ids, pos, mask, packed, [len(t) for t in tokens]).cpu()

    @torch.no_grad()
    def logits_all(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of [B, T] ids without the cache (perplexity)."""
        if self.dev:
            self.dev.start_step()
        return self.generic.logits_all(input_ids.to(self.device)).cpu()

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
        """Weight bytes every forward reads from RAM (resident layers and the head; the embedding
        lookup reads a few rows), a mixture of experts' experts apart: `routed_expert_bytes`."""
        emb = sum(p.nbytes for p in self.pieces[self.blocks[0].index])
        return self.resident_bytes - self.resident_expert_bytes - emb + (self.streamed_bytes if self.stream else 0)

    def routed_expert_bytes(self) -> int:
        """Bytes of the streamed experts the steps so far routed to (computed from RAM: cache hits,
        and misses once read)."""
        if self.routed_count is not None:
            return self.routed_count.bytes
        s = self.streamed_experts.cache.stats if self.streamed_experts else None
        return s.hit_bytes + s.miss_bytes if s else 0

    def expert_stats(self):
        """The expert cache's counts (tierlm.infer.experts.ExpertStats), or None."""
        return self.streamed_experts.cache.stats if self.streamed_experts else None

    def ssd_bytes_read(self) -> int:
        return self.store.store.stats.snapshot()["bytes_read"] if self.store else 0

    def decode_path(self) -> str:
        """Which code runs a decode step, and why not tierlm's own where it does not."""
        if self.dev:
            return f"decode: generic (transformers' modules on {self.device}: tierlm's native kernels are CPU code)"
        if self.lean is not None:
            if self.lean.fused is not None:
                return "decode: native (tierlm's fused kernels)"
            return "decode: native (tierlm's lean decoder, a kernel call per product)"
        if self.generic.masks == "layers":
            why = ("its forward builds attention biases from a 2-D key mask (BLOOM's ALiBi, Doge's dynamic mask) "
                   "and its layers take the engine's masks")
        elif self.generic.model_caches:
            failed = engine_failure(self.model) or "tierlm's KV cache cannot run it"
            why = (f"the load-time check found that {failed}, so each sequence keeps the cache the model makes "
                   "and the rows of a step run one at a time")
        elif self.generic.own_masks:
            why = ("its forward makes its own attention masks (the engine's failed the load-time check), so the rows "
                   "of a step run in groups of one position")
        elif not self.cfg.lean:
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
        where = self.expert_placement.describe() if self.expert_placement else self.placement.describe()
        if self.dev:
            where = f"{self.dev.describe()}" + (f"; host: {where}" if self.placement.layers else "")
        return f"{self.config.model_type}, weights {w}: {tp}{where}; {self.decode_path()}"

    def close(self) -> None:
        self.heap.close()
        if self.tp:
            self.tp.lead_stop()
            self.tp.shutdown()
            self.tp = None
        if self.dev:
            self.dev.close()
        if self.stream:
            self.stream.close()
        if self.store:
            self.store.close()


def _to(x, device: torch.device):
    """A step's tensor (or dict of masks) on the compute device."""
    if isinstance(x, dict):
        return {k: None if v is None else v.to(device) for k, v in x.items()}
    return None if x is None else x.to(device)
