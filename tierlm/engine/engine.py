"""The out-of-core training engine: a Hugging Face causal LM whose state lives on NVMe.

    engine = Engine.from_pretrained("my-model", EngineConfig(nvme_dir="run/nvme", cpu_mem="4GiB"))
    for input_ids, labels in batches:
        loss = engine.forward(input_ids, labels=labels).loss   # weights stream layer by layer
        engine.backward(loss)                                  # the optimizer runs beside it
        engine.step()                                          # commit: exact AdamW semantics
    engine.save_pretrained("out")

Working weights stream through a bounded window; each layer's gradients go to the out-of-core
AdamW the moment backward produces them; nothing of the model is resident beyond the window.
"""
from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import rss
from ..dist.grads import GradReducer, share_weights
from ..dist.state import attach
from ..faults import fault
from ..hf.baseline import library_baseline
from ..hf.names import model_to_checkpoint
from ..hf.safetensors_io import SafetensorsDir
from ..hf.structure import discover_blocks, empty_model, module_param_slots, weights_before_layers
from ..plan.budget import chunk_tokens
from ..plan.settings import Measured, ModelFacts, TrainSettings, resolve_train
from ..precision import resolve
from ..storage import HostBufferPool, TensorStore
from ..storage.commit import committed_shard_elems
from ..storage.layout import key, make_param_info
from ..storage.packed import PACK_BELOW
from ..units import fmt_bytes, parse_bytes
from .act_engine import ActivationPlanner
from .block_fn import ParamRefHooks, wrap_layer
from .budget_plan import plan_budget
from .device import Uploads, move_buffers, resolve_device, synchronize, to_host
from .durable import DurableState
from .export import Exports
from .head_loss import causal_lm_loss
from .heap import HeapGuard
from .next_rows import NextRows
from .optimizer import AdamWConfig, OptimizerDeps, OutOfCoreAdamW, OutOfCoreOptions, StepResult
from .state_quant import check_mode
from .tied import TiedHeadGrad
from .timeline import Timeline
from .weights import WeightWindow


@dataclass
class EngineConfig:
    nvme_dir: str
    cpu_mem: int | str = "4GiB"
    precision: str = "auto"          # bf16: bf16 compute, fp32 master; fp32: everything fp32; auto: measured
    grad_accum: int = 1
    activations: str = "auto"        # auto | keep | swap | swap-host | recompute, or one per layer, comma-separated
    prefetch: int | None = None      # blocks read ahead of the one computing; None: picked (io_settings)
    shard_elems: int | None = None   # optimizer shard size; None: bench io's pick within the budget where it
                                     # cannot change bits (one micro-batch a step), else the budget's (io_settings)
    io_threads: int | None = None    # reads (and writes) in flight; None: `tierlm bench io`'s pick for this file system, else 4
    direct_io: bool | None = None    # None: where the file system allows it
    state_cache: bool = True         # keep optimizer state in RAM between steps where the budget has room
    pack_below: int = PACK_BELOW     # tensors smaller (bytes) live in RAM, one pack file a commit (storage/packed.py); 0: none
    optim_states: str = "fp32"       # fp32 | bf16 | int8: how Adam's m and v are stored (state_quant)
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    tokens_per_micro_batch: int = 2048  # for the budget check; the trainer sets batch * seq_len
    micro_batch_size: int = 1        # sequences per micro-batch (to name the longest --seq-len that fits)
    plan_path: str | None = None     # where the activation planner writes plan.json
    device: str = "cpu"              # where layers compute: cpu, cuda[:N], or auto (the GPU if there is one;
                                     # finetune's default: the engine computes where it is told)
    gpu_mem: int | str | None = None  # GPU memory the run may use; None: 90% of what is free at start
    defer_commit: bool = True        # a step's last writes and its manifest land during the next forward
    early_tied: bool = True          # a tied head's rows the batch does not look up update at the start of backward
    next_rows: bool = True           # expect(): the next lookup's embedding rows are kept from the update
    loss_chunk: int | None = None    # head + loss tokens a chunk: None = when the logits are large
                                     # (head_loss.chunk_tokens), 0 = never, N = N tokens (tests)

    def __post_init__(self):
        self.cpu_mem = parse_bytes(self.cpu_mem, "cpu_mem")
        if self.gpu_mem is not None:
            self.gpu_mem = parse_bytes(self.gpu_mem, "gpu_mem")
        self.device = str(resolve_device(self.device))
        self.precision = resolve(self.precision, self.device)[0]
        pols = self.activations.split(",")
        allowed = ("keep", "swap", "swap-host", "recompute")
        if not (pols == ["auto"] or all(p in allowed for p in pols)):
            raise ValueError(f"--activations must be auto, keep, swap, swap-host or recompute, or one of the "
                             f"last four per decoder layer separated by commas; got {self.activations!r}")
        if self.grad_accum < 1:
            raise ValueError("grad_accum must be >= 1")
        check_mode(self.optim_states)


class Engine(DurableState, Exports):
    def __init__(self, model: nn.Module, source, cfg: EngineConfig, resume: bool = False, overwrite: bool = False,
                 library_rss: int | None = None, dist=None, settings: TrainSettings | None = None):
        """model: an HF causal LM whose parameters may be on `meta` (see from_pretrained);
        source(name, out_fp32) fills the fp32 initial value of a parameter (used unless resuming);
        library_rss: RSS of the libraries alone (budget.library_baseline); what the process holds
        beyond it counts against cfg.cpu_mem. Default: measured now;
        dist: a data-parallel rank (tierlm.dist.Dist) or None for one process: the optimizer state
        of the parameters this rank owns lives in cfg.nvme_dir, the working weights of all;
        settings: the run's automatic choices (`tierlm.plan.settings.resolve_train`, from what the
        recipe measured); None: resolved here from cfg and defaults, no measurement read."""
        self.cfg = cfg
        self.dist = dist
        self.config = model.config
        self.dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        self.device = torch.device(cfg.device)
        self.on_gpu = self.device.type == "cuda"
        if self.on_gpu and dist is not None:
            raise ValueError("data parallelism (--nproc, torchrun) computes on the CPU for now: pass --device cpu")
        self.training = True
        self.model = model
        early = weights_before_layers(model.config)
        if early:
            raise ValueError(f"{model.config.model_type}: {', '.join(early)} run before the decoder layers and are "
                             "not embeddings; the fine-tuning engine does not stream such weights yet")
        move_buffers(model, self.device)
        self.blocks, params = discover_blocks(model)
        self.names = list(params)  # canonical order: model.parameters()
        self.settings = settings or train_settings(cfg, model, resume)
        self.shard_elems, self.shard_why = self.settings.shard_elems.value, self.settings.shard_elems.why
        self.infos = {n: make_param_info(n, tuple(p.shape), self.shard_elems) for n, p in params.items()}
        self._install_params(model)
        self.hooks = ParamRefHooks()
        self.next_rows: NextRows | None = None  # the next forward's embedding rows (expect)
        for blk in self.blocks:
            if blk.kind == "layer":
                wrap_layer(self, blk, blk.module)
        self._hook_embed_and_head()

        self.timeline = Timeline()
        on_event = self.timeline.event
        root = Path(cfg.nvme_dir)
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        rss.trim()
        self.library_rss = library_rss if library_rss is not None else \
            library_baseline(self.config, self.dtype, self.device)
        baseline = rss.current_rss() - self.library_rss
        self.prefetch, self.prefetch_why = self.settings.prefetch.value, self.settings.prefetch.why
        self.split, self.act_allowance = plan_budget(self, max(baseline, 0))
        # pinned where a GPU reads it: copies from pageable memory are neither async nor fast
        self.window_pool = HostBufferPool(self.split.window, pin=self.on_gpu, name="weight window", arena=True)
        self.opt_pool = HostBufferPool(self.split.optimizer, name="optimizer buffers", arena=True)
        self.cache_pool = HostBufferPool(self.split.state_cache, name="optimizer state cache") \
            if self.split.state_cache > 0 and cfg.state_cache else None
        self.io_threads, self.io_threads_why = self.settings.io_threads.value, self.settings.io_threads.why
        self.store = TensorStore(root, self.opt_pool, io_threads=self.io_threads,
                                 direct_io=cfg.direct_io, on_event=on_event, pack_below=cfg.pack_below)
        self.fallbacks: list[str] = []  # committed states passed over on resume, and why
        if dist is not None:
            attach(self, resume, overwrite)  # ownership; on resume, this rank's share of the state
        self.state = self._load_or_import(source, resume, overwrite)
        weight_dtype = None if self.dtype == torch.float32 else self.dtype
        backward_order = [n for blk in reversed(self.blocks) for n in blk.owns]
        self.acts = ActivationPlanner(self, on_event)
        self.hooks.swapper = self.acts.swapper
        self.optimizer = OutOfCoreAdamW(
            OptimizerDeps(self.store, self.opt_pool, state_cache=self.cache_pool, dist=dist, on_event=on_event,
                          on_new_weights=self._new_weights),
            self.infos, [n for n in backward_order if self._owned(n)], self.names, cfg.optim, self.state["optim"],
            OutOfCoreOptions(weight_dtype, cfg.optim_states, max_pending_grad_bytes=self.split.pending_grads))
        if dist is not None:
            self.reducer = GradReducer(dist, backward_order, self.optimizer, self.split.pending_grads)
        self.window = WeightWindow(self.store, self.window_pool, self.infos, self.dtype,
                                   lambda n, k: key(self._wkind(n), n, k, self.optimizer.slots[n]),
                                   stash=self.split.weights_kept > 0)
        self.uploads = Uploads(self.device, self.window) if self.on_gpu else None
        # Deferred commit: the next forward reads (the store orders each read after the write of
        # its file) and writes nothing; the next backward's first write waits for the manifest.
        # Ranks commit together through collectives, on their main threads: not deferred there.
        self.optimizer.defer_writes = cfg.defer_commit and dist is None
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierlm-commit")
        self._commit_fut: Future | None = None
        self.micro = 0
        self.lr = cfg.optim.lr
        self._held_head: list[str] = []
        self._t_head: float | None = None
        self._t_bwd: float | None = None
        self._pins: dict[str, int] = {}
        self.tied_grad = TiedHeadGrad.attach(self)
        # last, so a constructor that raises leaves glibc's settings alone: between blocks, RSS at
        # most the budget less what the next block's compute may add
        self.heap = HeapGuard(self.library_rss + self.split.budget - self.split.compute, self.split.transient)

    def settings_record(self) -> dict:
        """Every automatic choice of this run with its reason, and the budget split made from them:
        printed at the start, kept in the run directory as settings.json."""
        return {**self.settings.to_dict(), "budget_split": {"value": asdict(self.split), "why": self.split_why()},
                "activation_allowance": self.act_allowance}

    def split_why(self) -> str:
        return f"--cpu-mem {fmt_bytes(self.cfg.cpu_mem)} split by tierlm.plan.budget.plan_split for this model"

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir, cfg: EngineConfig, resume: bool = False, overwrite: bool = False,
                        measured: Measured | None = None, **kw) -> "Engine":
        """measured: what the recipe read of this machine's measurements (`tierlm.bench.rates`), from
        which the run's settings are resolved; None: defaults."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        model = empty_model(config)
        st = SafetensorsDir(model_dir)
        in_file = model_to_checkpoint(model, st.names(), dict(model.named_parameters()), where=str(model_dir))

        def source(name: str, out: torch.Tensor) -> None:
            if name not in in_file:
                raise ValueError(f"{model_dir}: the checkpoint has no tensor {name!r} that "
                                 f"{type(model).__name__} needs; is this the right model directory?")
            ck = in_file[name]
            dt, _ = st.info(ck)
            if dt == torch.float32:
                st.read(ck, out)
            else:
                tmp = torch.empty(out.shape, dtype=dt)
                st.read(ck, tmp)
                out.copy_(tmp)
        settings = train_settings(cfg, model, resume, measured)
        eng = cls(model, source, cfg, resume=resume, overwrite=overwrite, settings=settings, **kw)
        eng.model_dir = str(model_dir)
        return eng

    @classmethod
    def from_model(cls, model: nn.Module, cfg: EngineConfig, **kw) -> "Engine":
        """Wrap a user's in-memory transformers model: its weights move to NVMe and are freed."""
        values = {n: p.detach() for n, p in model.named_parameters()}

        def source(name: str, out: torch.Tensor) -> None:
            out.copy_(values.pop(name).reshape(out.shape))
        return cls(model, source, cfg, **kw)

    def _install_params(self, model: nn.Module) -> None:
        """Replace every parameter (meta or real) by an empty CPU one: data arrives per block."""
        self.params: dict[str, nn.Parameter] = {}
        # Removed at close: a tensor's hook that refers to the engine makes a cycle the collector
        # cannot see through the tensor, so every closed engine stayed alive (~3 MiB a run of the
        # tests' tiny model, the whole model's modules and threads' objects).
        self._grad_hooks = []
        name_shape = {n: i.shape for n, i in self.infos.items()}
        for name, slots in module_param_slots(model).items():
            p = nn.Parameter(self._placeholder(name_shape[name]))
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(lambda prm, n=name: self._on_grad(n, prm)))
            for mod, attr in slots:
                mod._parameters[attr] = p
            self.params[name] = p

    def _hook_embed_and_head(self) -> None:
        by_kind = {b.kind: b for b in self.blocks if b.kind != "layer"}
        slots = module_param_slots(self.model)
        for kind in ("embed", "head"):
            blk = by_kind[kind]
            # Tied weights sit in an Embedding and in lm_head: each block hooks its own kind.
            mods = {id(m): (m, attr) for n in blk.uses for m, attr in slots[n]
                    if isinstance(m, nn.Embedding) == (kind == "embed")}
            for mod, attr in mods.values():
                names = [self._canon(mod, a) for a in mod._parameters if mod._parameters[a] is not None]
                if kind == "embed":
                    if len(mods) == 1 and names == blk.uses and len(names) == 1 and NextRows.usable(mod):
                        self.next_rows = NextRows(names[0], self.infos[names[0]], self.dtype)
                    mod.register_forward_pre_hook(lambda m, a, ns=names: self._embed_in(m, a, ns))
                    mod.register_forward_hook(lambda m, a, o, ns=names: self._embed_out(m, a, ns))
                else:
                    mod.register_forward_pre_hook(lambda m, a, ns=names: self._hold_head(ns))

    def _embed_in(self, mod: nn.Module, args, names) -> None:
        nr = self.next_rows
        got = nr.take(args[0]) if nr is not None and names == [nr.name] and args else None
        if got is not None:
            mod._tierlm_rows = got  # the lookup takes the expected rows: the weight stays unread
        else:
            self._load(names)

    def _embed_out(self, mod: nn.Module, args, names):
        got = mod.__dict__.pop("_tierlm_rows", None)
        if got is None:
            self._unload(names)
            return None
        # replaces the output F.embedding computed from the unloaded (placeholder) weight
        tied = self.tied_grad if self.tied_grad is not None and self.tied_grad.name == self.next_rows.name else None
        return self.next_rows.lookup(mod, self.params[self.next_rows.name], args[0], *got, taker=tied)

    def expect(self, input_ids: torch.Tensor) -> None:
        """The input ids of the forward after this step, when known before its (last) backward: the
        embedding rows they look up are kept from this step's update, and that forward reads no
        embedding (next_rows). Any other forward reads it as before."""
        if self.next_rows is not None and self.cfg.next_rows:
            self.next_rows.expect(input_ids)

    def _new_weights(self, name: str, shard: int, values: torch.Tensor) -> None:
        self.window.offer(name, shard, values)
        if self.next_rows is not None and name == self.next_rows.name:
            self.next_rows.offer(shard, values)

    def _canon(self, mod: nn.Module, attr: str) -> str:
        p = mod._parameters[attr]
        return next(n for n, q in self.params.items() if q is p)

    # ---- weights in and out of the modules ---------------------------------------------
    def _load(self, names) -> None:
        t0 = time.perf_counter()
        with self.timeline.span("wait", "weights"):
            if self.uploads is None:
                tensors = self.window.acquire(names)
            else:
                tensors = {n: self.uploads.get(n) for n in names}
        self.acts.waited(time.perf_counter() - t0)
        for n, t in tensors.items():
            self._pins[n] = self._pins.get(n, 0) + 1
            if self._pins[n] == 1:
                p = self.params[n]
                p.data = t
                self.hooks.track(p)

    def _unload(self, names) -> None:
        for n in names:
            self._pins[n] -= 1
            if self._pins[n] == 0:  # a tied weight stays while another block still uses it
                p = self.params[n]
                self.hooks.untrack(p)
                p.data = self._placeholder(p.shape)
                if self.uploads is not None:
                    self.uploads.drop(n)
        if self.uploads is None:
            self.window.release(names)

    def _placeholder(self, shape) -> torch.Tensor:
        """An unloaded parameter: the right shape (autograd checks it when accumulating a
        gradient) over a single element of memory."""
        return torch.zeros(1, dtype=self.dtype, device=self.device).expand(shape)

    def _hold_head(self, names) -> None:
        self.heap.check()
        new = [n for n in names if n not in self._held_head]
        if new:
            self._load(new)
            self._held_head.extend(new)
        if self._t_head is None:
            self._t_head = time.perf_counter()  # the head and loss compute from here (timeline)

    def _head_computed(self, phase: str, t0: float | None) -> None:
        if t0 is not None:
            synchronize(self.device)
            self.timeline.event("compute", f"{phase} head and loss", t0, time.perf_counter())

    def _drop_head(self) -> None:
        if self._held_head:
            held, self._held_head = self._held_head, []
            self._unload(held)

    def _upload_ahead(self, j: int) -> None:
        """The next layer's weights to the GPU while this one computes, if its read has landed
        (only layers: the embedding has no backward use, the head is held by its own hook)."""
        if self.uploads is not None and 0 <= j < len(self.blocks) and self.blocks[j].kind == "layer":
            self.uploads.upload(self.blocks[j].uses, blocking=False)

    def _prefetch_from(self, index: int, step: int) -> None:
        for d in range(1, self.prefetch + 1):
            j = index + d * step
            if 0 <= j < len(self.blocks):
                if self.blocks[j].kind == "embed" and self.next_rows is not None and self.next_rows.pending():
                    continue  # the next lookup has its rows
                self.window.prefetch(self.blocks[j].uses)

    # called by the layer wrappers
    def block_forward_begin(self, blk) -> None:
        fault("forward.layer")
        self.heap.check()
        self._prefetch_from(blk.index, +1)
        self._load(blk.uses)
        self._upload_ahead(blk.index + 1)
        self.hooks.begin_count()
        self.acts.forward_begin(blk)
        self._t_compute = time.perf_counter()

    def block_forward_end(self, blk) -> None:
        synchronize(self.device)
        t1 = time.perf_counter()
        self.timeline.event("compute", f"fwd {blk.name}", self._t_compute, t1)
        self.acts.forward_end(blk, t1 - self._t_compute, self.hooks.end_count())
        self._unload(blk.uses)

    def block_backward_begin(self, blk) -> None:
        fault("backward.layer")
        self.heap.check()
        if self._held_head:
            self._head_computed("bwd", self._t_bwd)
        self._drop_head()  # the head's backward is over once a layer's starts
        self._load(blk.uses)
        self._prefetch_from(blk.index, -1)
        self._upload_ahead(blk.index - 1)
        self.acts.backward_begin(blk)
        self.hooks.begin_count()
        self._blocked0 = self.optimizer.blocked_s
        self._t_compute = time.perf_counter()

    def block_backward_end(self, blk) -> None:
        synchronize(self.device)
        t1 = time.perf_counter()
        self.timeline.event("compute", f"bwd {blk.name}", self._t_compute, t1)
        # time spent handing gradients to an optimizer that was behind is a wait, not compute
        blocked = self.optimizer.blocked_s - self._blocked0
        self.acts.waited(blocked)
        self.acts.backward_end(blk, t1 - self._t_compute - blocked, self.hooks.end_count())
        self._unload(blk.uses)

    def policy_for(self, blk) -> str:
        return self.acts.policy_for(blk)

    # ---- training API ------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs):
        """The HF model's forward (returns its output, `.loss` when labels are given)."""
        self.acts.micro_begin()
        self._drop_head()
        self.heap.check()
        self._prefetch_from(-1, +1)
        if self.on_gpu:
            input_ids = input_ids.to(self.device)
            labels = labels.to(self.device) if labels is not None else None
            kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        chunk = self._loss_chunk(input_ids.numel()) if labels is not None and torch.is_grad_enabled() else None
        if self.tied_grad is not None:
            self.tied_grad.ids = input_ids
        with self.hooks:
            kwargs.setdefault("use_cache", False)
            if chunk:
                from transformers.modeling_outputs import CausalLMOutputWithPast
                hidden = self.model.base_model(input_ids=input_ids, **kwargs).last_hidden_state
                out = CausalLMOutputWithPast(loss=causal_lm_loss(hidden, self.model.get_output_embeddings(),
                                                                 labels, chunk))
            else:
                out = self.model(input_ids=input_ids, labels=labels, **kwargs)
        self._head_computed("fwd", self._t_head)
        self._t_head = None
        if not torch.is_grad_enabled():
            self._drop_head()
        return out

    def _chunkable(self) -> bool:
        """Only a plain linear head can run in chunks: a soft-capped or scaled head's logits are not head(h)."""
        head = self.model.get_output_embeddings()
        return type(head) is nn.Linear and not getattr(self.config, "final_logit_softcapping", None)

    def _loss_chunk(self, tokens: int) -> int | None:
        """Tokens a chunk of the head and loss (head_loss), or None for the model's own forward."""
        if not self._chunkable():
            return None
        return chunk_tokens(tokens, self.config.vocab_size, self.dtype, self.cfg.loss_chunk)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of loss / grad_accum; the optimizer consumes the gradients as they appear."""
        if self.micro >= self.cfg.grad_accum:
            raise RuntimeError(f"backward called {self.micro + 1} times for grad_accum="
                               f"{self.cfg.grad_accum}; call step() after each {self.cfg.grad_accum}")
        self.settle()  # backward writes: the slot it writes is the one the last manifest replaced
        self.acts.backward_phase()
        self.optimizer.begin_micro(self.micro, self.cfg.grad_accum, self.lr)
        if self.dist is not None:
            self.reducer.begin()
        self.heap.check()
        self._t_bwd = time.perf_counter()
        try:
            (loss / self.cfg.grad_accum).backward()
            rest = self.tied_grad.leftover() if self.tied_grad is not None else None
            if rest is not None:  # the embedding had no gradient (its input did not need one)
                self._hand_over(self.tied_grad.name, to_host(rest), held=True)
        finally:
            if self.tied_grad is not None:
                self.tied_grad.head_grad = None  # a backward that failed hands nothing over
            self._drop_head()
            t0 = time.perf_counter()
            if self.dist is not None:
                with self.timeline.span("wait", "gradient reduce"):
                    self.reducer.flush()
            with self.timeline.span("wait", "optimizer"):
                self.optimizer.end_micro()
            self.acts.waited(time.perf_counter() - t0)
            self.acts.backward_done()
        self.micro += 1

    def finish(self) -> StepResult:
        """The step's update, done but not yet current: exact clipping (redo if torch would clip)."""
        if self.micro != self.cfg.grad_accum:
            raise RuntimeError(f"step() after {self.micro} of {self.cfg.grad_accum} backward calls")
        self.micro = 0
        t0 = time.perf_counter()
        with self.timeline.span("wait", "clip redo" if self.cfg.optim.max_grad_norm else "finish"):
            self._result = self.optimizer.finish_step()
        self.acts.waited(time.perf_counter() - t0)
        if self.dist is not None and self._result.finite:
            with self.timeline.span("wait", "weights from owners"):
                share_weights(self, self.optimizer.stepped)
        return self._result

    def commit(self) -> None:
        """Make the finished step the state (atomically). A step with non-finite gradients is not
        applied: the weights and optimizer state stay those before it; the step still counts."""
        res = self._result
        self.window.invalidate_all(keep_renewed=res.finite)  # the first blocks' new weights stay
        if self.next_rows is not None:
            self.next_rows.commit(res.finite)
        if res.finite:
            self.optimizer.commit()
        else:
            self.optimizer.discard()
        self.state["step"] += 1
        tail = self.optimizer.take_tail()
        if self.optimizer.defer_writes:
            self._commit_fut = self._committer.submit(self._land_and_commit, tail, copy.deepcopy(self.state))
        else:
            for f in tail:
                f.result()
            self._write_manifest()
        self.heap.check()
        self.acts.step_done()
        self._prefetch_from(-1, +1)

    def step(self) -> StepResult:
        """finish() and commit()."""
        res = self.finish()
        self.commit()
        return res

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def _on_grad(self, name: str, p: nn.Parameter) -> None:
        g, p.grad = p.grad, None
        if g is None:  # every use routed its gradient around autograd (a tied head and its rows)
            return
        held = False
        if self.tied_grad is not None:
            held = name == self.tied_grad.name and self.tied_grad.head_grad is not None
            g = self.tied_grad.add_to(name, g)  # where the gradient is: on a GPU, one copy crosses
        self._hand_over(name, to_host(g), held)

    def _hand_over(self, name: str, g: torch.Tensor, held: bool = False) -> None:
        """held: `g` takes the memory of the tied head's gradient, which the budget held through
        backward (Split.held_grad): it waits for the optimizer without taking the gradients' share."""
        if self.dist is not None:
            self.reducer.grad(name, g)  # summed over the ranks into the owner's optimizer
        else:
            self.optimizer.grad_ready(name, g, held=held)

    def _owned(self, name: str) -> bool:
        """Does this process hold the parameter's master weights and moments?"""
        return self.dist is None or self.dist.owns(name)

    def _wkind(self, name: str) -> str:
        """The store kind of the working weights: fp32 runs use the master where it is here."""
        return "master" if self.dtype == torch.float32 and self._owned(name) else "w"

    def stats(self) -> dict:
        return {"io": self.store.stats.snapshot(), "window_hits": self.window.hits,
                "window_misses": self.window.misses, "peak_rss": rss.peak_rss(), "heap_trims": self.heap.trims,
                "pools": {"window": self.window_pool.peak_used, "optimizer": self.opt_pool.peak_used},
                "peak_gpu": torch.cuda.max_memory_allocated(self.device) if self.on_gpu else None}

    def close(self) -> None:
        self.heap.close()  # the steps are over: what they kept for reuse goes back first
        try:
            self.settle()
        finally:
            self._committer.shutdown(wait=True)
            self.acts.close()
            self.optimizer.close()
            self.store.close()
            for h in self._grad_hooks:
                h.remove()


__all__ = ["Engine", "EngineConfig", "AdamWConfig"]


def model_facts(model: nn.Module) -> ModelFacts:
    """The largest decoder layer's parameters and the width: what the run's choices need of it."""
    blocks, params = discover_blocks(model)
    layer = max((sum(params[n].numel() for n in b.uses) for b in blocks if b.kind == "layer"), default=0)
    return ModelFacts(layer, model.config.hidden_size)


def train_settings(cfg: EngineConfig, model: nn.Module, resume: bool, measured: Measured | None = None) -> TrainSettings:
    """The run's automatic choices for this model: from what the recipe measured (`tierlm.bench.rates`),
    or from defaults; a resumed run keeps its committed state's shard size."""
    committed = committed_shard_elems(Path(cfg.nvme_dir)) if resume else None
    return resolve_train(cfg, measured or Measured(), model_facts(model), committed)
