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
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from .. import rss
from ..dist.buckets import make_reducer
from ..dist.grads import share_weights
from ..dist.state import attach
from ..hf.baseline import library_baseline
from ..hf.names import load_buffers, model_to_checkpoint
from ..hf.meta_forward import layer_calls, sees_later_tokens
from ..hf.stacked import read_param
from ..hf.safetensors_io import SafetensorsDir
from ..hf.structure import (discover_blocks, empty_model, fixed_params_to_buffers, kept_fp32,
                            module_param_slots, stacked_experts, weights_before_layers)
from ..plan.budget import chunk_tokens
from ..plan.settings import Measured, TrainSettings
from ..storage import HostBufferPool, TensorStore
from ..storage.layout import key, make_param_info
from ..units import fmt_bytes
from .act_engine import ActivationPlanner
from .commit_schedule import CommitSchedule
from .block_fn import ParamRefHooks, wrap_layer
from .budget_plan import plan_budget
from .device import Uploads, move_buffers, to_host
from .durable import DurableState
from .export import Exports
from .options import EngineConfig, train_settings  # noqa: F401  (EngineConfig: callers import it here)
from .residency import BlockResidency
from .head_loss import adds_router_loss, chunked_forward
from ..heap import HeapGuard
from .next_rows import NextRows
from .optimizer import AdamWConfig, OptimizerDeps, OutOfCoreAdamW, OutOfCoreOptions, StepResult
from .tied import TiedHeadGrad
from .expert_io import ExpertIO
from .timeline import Timeline
from .weights import WeightWindow




class Engine(DurableState, Exports, BlockResidency):
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
        if dist is not None and dist.device != self.device:
            raise ValueError(f"this rank's gradients are reduced on {dist.device} and its layers compute on "
                             f"{self.device}: make the rank with tierlm.dist.from_env(timeout, device)")
        self.training = True
        self.model = model
        self._take_model(model, settings or train_settings(cfg, model, resume))
        self.timeline = Timeline()
        self._memory(library_rss)
        self.fallbacks: list[str] = []  # committed states passed over on resume, and why
        if dist is not None:
            attach(self, resume, overwrite)  # ownership; on resume, this rank's share of the state
        self.state = self._load_or_import(source, resume, overwrite)
        self._optimizer_and_window()
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierlm-commit")
        self._commit_fut: Future | None = None
        self.micro = 0
        self.lr = cfg.optim.lr
        self._held_head: list[str] = []
        self._held_early: list[str] = []
        self._t_head: float | None = None
        self._t_bwd: float | None = None
        self._pins: dict[str, int] = {}
        self.tied_grad = TiedHeadGrad.attach(self)
        # last, so a constructor that raises leaves glibc's settings alone: between blocks, RSS at
        # most the budget less what the next block's compute may add
        self.heap = HeapGuard(self.library_rss + self.split.budget - self.split.compute, self.split.transient)

    def _take_model(self, model: nn.Module, settings: TrainSettings) -> None:
        """The model's parameters become the engine's (empty until a block needs them), cut in
        the settings' shards; its layers, embedding and head get the engine's hooks."""
        # parameters the modules keep fixed get no gradient, and the step would wait for one: they
        # become buffers, kept as they are (from_pretrained has done so before reading buffers)
        unread = [n for n, p in model.named_parameters() if not p.requires_grad and p.device.type == "meta"]
        if unread:
            raise ValueError(f"{model.config.model_type}: its modules keep {', '.join(unread[:3])} fixed "
                             "(requires_grad=False) and the model given holds no value for them; load it with "
                             "Engine.from_pretrained, which reads them from the checkpoint")
        fixed_params_to_buffers(model)
        move_buffers(model, self.device)
        # weights a forward uses before the first layer (not embeddings: BLOOM's embedding norm)
        # are needed again at the end of backward: the embed block's, held through the step
        self.blocks, params = discover_blocks(model, weights_before_layers(model.config))
        self.names = list(params)  # canonical order: model.parameters()
        borrowed = [(b.name, n) for b in self.blocks if b.kind == "layer" for n in b.uses if n not in b.owns]
        if borrowed:
            # (Zamba's shared transformer block, run by every hybrid layer)
            raise ValueError(f"{model.config.model_type}: its decoder layers share weights ({borrowed[0][0]} runs "
                             f"{borrowed[0][1]}); the fine-tuning engine updates a weight when its own layer's "
                             "backward ends and does not yet gather the gradients other layers send it")
        if sees_later_tokens(model.config):
            fix = ('set "is_decoder": true in its config.json' if getattr(model.config, "is_decoder", None) is False
                   else "tierlm fine-tunes causal language models")
            raise ValueError(f"{model.config.model_type}: its tokens see later ones (on a small copy, changing the last "
                             f"token moved the logits before it), so a next-token loss would train it to copy its "
                             f"input; {fix}")
        calls = layer_calls(model.config)
        if calls and max(calls) > 1:
            i = max(range(len(calls)), key=calls.__getitem__)
            raise ValueError(f"{model.config.model_type}: its forward runs decoder layer {i} {calls[i]} times (a "
                             "recurrent-depth model loops over its layers); the fine-tuning engine runs each layer's "
                             "forward and backward once a step, so it does not fine-tune it (generating runs)")
        self.settings = settings
        self.shard_elems, self.shard_why = settings.shard_elems.value, settings.shard_elems.why
        self.prefetch, self.prefetch_why = settings.prefetch.value, settings.prefetch.why
        self.io_threads, self.io_threads_why = settings.io_threads.value, settings.io_threads.why
        # a stacked experts' parameter is cut on expert boundaries: an expert no token reached
        # then owns shards of its own, which the optimizer can leave alone (expert_state.py)
        experts = stacked_experts(model)
        self.infos = {n: make_param_info(n, tuple(p.shape), self.shard_elems, experts.get(n, 0))
                      for n, p in params.items()}
        # what transformers keeps in fp32 when it loads the family in this dtype (a mixture's
        # router weights: their modules compute in fp32): trained with fp32 working weights
        self.kept32 = frozenset(kept_fp32(model, self.dtype) & set(params))
        self._install_params(model)
        self.hooks = ParamRefHooks()
        self.next_rows: NextRows | None = None  # the next forward's embedding rows (expect)
        for blk in self.blocks:
            if blk.kind == "layer":
                wrap_layer(self, blk, blk.module)
        self._hook_embed_and_head()

    def _memory(self, library_rss: int | None) -> None:
        """The budget split beyond the libraries' RSS, its pools, and the store on cfg.nvme_dir."""
        cfg = self.cfg
        self.root = Path(cfg.nvme_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        rss.trim()
        self.library_rss = library_rss if library_rss is not None else \
            library_baseline(self.config, self.dtype, self.device)
        baseline = rss.current_rss() - self.library_rss
        self.split, self.act_allowance = plan_budget(self, max(baseline, 0))
        # pinned where a GPU reads it: copies from pageable memory are neither async nor fast
        self.window_pool = HostBufferPool(self.split.window, pin=self.on_gpu, name="weight window", arena=True)
        self.opt_pool = HostBufferPool(self.split.optimizer, name="optimizer buffers", arena=True)
        self.cache_pool = HostBufferPool(self.split.state_cache, name="optimizer state cache") \
            if self.split.state_cache > 0 and cfg.state_cache else None
        self.store = TensorStore(self.root, self.opt_pool, io_threads=self.io_threads,
                                 direct_io=cfg.direct_io, on_event=self.timeline.event, pack_below=cfg.pack_below)

    def _optimizer_and_window(self) -> None:
        """The activation planner, the out-of-core optimizer (and a rank's gradient reducer), and
        the weight window the steps read through."""
        cfg, dist, on_event = self.cfg, self.dist, self.timeline.event
        weight_dtype = None if self.dtype == torch.float32 else self.dtype
        backward_order = [n for blk in reversed(self.blocks) for n in blk.owns]
        self.acts = ActivationPlanner(self, on_event)
        self.expert_io = ExpertIO(self.infos)  # the stacked experts' state bytes, expert by expert
        self.hooks.swapper = self.acts.swapper
        self.optimizer = OutOfCoreAdamW(
            OptimizerDeps(self.expert_io.wrap(self.store), self.opt_pool, state_cache=self.cache_pool, dist=dist,
                          on_event=on_event,
                          on_new_weights=self._new_weights, on_unchanged=self._unchanged_weights),
            self.infos, [n for n in backward_order if self._owned(n)], self.names, cfg.optim, self.state["optim"],
            OutOfCoreOptions(weight_dtype, cfg.optim_states, max_pending_grad_bytes=self.split.pending_grads,
                             clip_path=cfg.clip_path, fp32_weights=self.kept32))
        if dist is not None:
            self.reducer = make_reducer(dist, backward_order, self.optimizer, self.split.pending_grads,
                                        {n: i.shape for n, i in self.infos.items()})
        self.commits = CommitSchedule(cfg.commit_every, self.settings.measured, dist is not None)
        self.optimizer.every_step = self.commits.every_step
        self.force_commit = False  # the trainer's: the next step commits whatever the interval
        self._durable = True
        self.window = WeightWindow(self.store, self.window_pool, self.infos, self.wdtype,
                                   lambda n, k: key(self._wkind(n), n, k, self.optimizer.weights_slot(n, k)),
                                   stash=self.split.weights_kept > 0)
        self.uploads = Uploads(self.device, self.window) if self.on_gpu else None
        # Deferred commit: the next forward reads (the store orders each read after the write of
        # its file) and writes nothing; the next backward's first write waits for the manifest.
        # Ranks commit together through collectives, on their main threads: not deferred there.
        self.optimizer.defer_writes = cfg.defer_commit and dist is None
        # ... and so does a held step's update, block by block ahead of the forward that reads them
        self.optimizer.defer_apply = self.optimizer.defer_writes
        self.optimizer.on_apply_failed = self._apply_failed
        self.optimizer.on_apply_start = self._apply_starts

    def _apply_starts(self, names: list[str]) -> None:
        """A held step's update is about to run beside the next forward: the window's entries and
        the expected embedding rows await its offers (before its first one)."""
        self.window.await_renewal(names)
        if self.next_rows is not None:
            self.next_rows.update_starts()

    def _apply_failed(self, error: BaseException) -> None:
        """A deferred update stopped: blocks and a lookup waiting for its weights give up."""
        self.window.fail_awaiting(error)
        if self.next_rows is not None:
            self.next_rows.end_deferred()

    def settings_record(self) -> dict:
        """Every automatic choice of this run with its reason, and the budget split made from them:
        printed at the start, kept in the run directory as settings.json."""
        return {**self.settings.to_dict(),
                "commit_every": {"value": self.commits.every.describe(), "why": self.commits.why},
                "budget_split": {"value": asdict(self.split), "why": self.split_why()},
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
        fixed_params_to_buffers(model)  # read and saved as they are (hf.structure)
        st = SafetensorsDir(model_dir)
        in_file = model_to_checkpoint(model, st.names(), dict(model.named_parameters()), where=str(model_dir))
        load_buffers(model, st, str(model_dir))

        def source(name: str, out: torch.Tensor) -> None:
            if name not in in_file:
                raise ValueError(f"{model_dir}: the checkpoint has no tensor {name!r} that "
                                 f"{type(model).__name__} needs; is this the right model directory?")
            read_param(st, in_file[name], out)
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
            p = nn.Parameter(self._placeholder(name, name_shape[name]))
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(lambda prm, n=name: self._on_grad(n, prm)))
            for mod, attr in slots:
                mod._parameters[attr] = p
            self.params[name] = p


    # ---- training API ------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs):
        """The HF model's forward (returns its output, `.loss` when labels are given)."""
        self.acts.micro_begin()
        self._drop_head()
        self._drop_early()
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
                out = chunked_forward(self.model, input_ids, labels, chunk, **kwargs)
            else:
                out = self.model(input_ids=input_ids, labels=labels, **kwargs)
        self._head_computed("fwd", self._t_head)
        self._t_head = None
        if not torch.is_grad_enabled():
            self._drop_head()
            self._drop_early()
        return out

    def _chunkable(self) -> bool:
        """Only a plain linear head can run in chunks: a soft-capped or scaled head's logits are not head(h)."""
        head = self.model.get_output_embeddings()
        return type(head) is nn.Linear and not getattr(self.config, "final_logit_softcapping", None) \
            and adds_router_loss(self.model) is not None

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
        if self.micro == 0:
            self._durable = self.commits.due(self.state["step"] + 1, self.force_commit)
            self.optimizer.durable = self._durable
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
            self._drop_early()  # their backward, the last but the embedding's, is over
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
        """The step's update, done but not yet current: exact clipping (a held step's update, or a
        speculative one's redo where torch clips)."""
        if self.micro != self.cfg.grad_accum:
            raise RuntimeError(f"step() after {self.micro} of {self.cfg.grad_accum} backward calls")
        self.micro = 0
        t0 = time.perf_counter()
        what = ("update (held for the clip)" if self.optimizer.holding and not self.optimizer.defer_apply
                else "gradient norm" if self.optimizer.holding
                else "clip redo" if self.cfg.optim.max_grad_norm else "finish")
        with self.timeline.span("wait", what):
            self._result = self.optimizer.finish_step()
        skipped, self.optimizer.skip_log = self.optimizer.skip_log, []
        self._result.experts = self.expert_io.lap(skipped)
        self.acts.waited(time.perf_counter() - t0)
        if self.dist is not None and self._result.finite:
            with self.timeline.span("wait", "weights from owners"):
                share_weights(self, self.optimizer.stepped)
        return self._result

    def commit(self) -> None:
        """Make the finished step the state (atomically). A step with non-finite gradients is not
        applied: the weights and optimizer state stay those before it; the step still counts."""
        res, durable = self._result, self._durable
        if not self.optimizer.applying:  # (a deferred update's entries await its weights: await_renewal)
            self.window.invalidate_all(keep_renewed=res.finite)  # the first blocks' new weights stay
        if self.next_rows is not None:
            self.next_rows.commit(res.finite, deferred=self.optimizer.applying)
        if self.optimizer.applying:  # the update runs beside the next forward; the commit after it
            self._commit_after_apply(durable)
        elif res.finite:
            self._end_step(durable, self.optimizer.commit(durable))
        else:
            self.optimizer.discard()
            self._end_step(durable, self.optimizer.make_durable() if durable else [])
        self.heap.check()
        self.acts.step_done()
        self._prefetch_from(-1, +1)

    def _commit_after_apply(self, durable: bool) -> None:
        """A deferred update's step: counted now; its bookkeeping, writes and manifest follow the
        update on the commit thread (the next backward waits for them: settle)."""
        self.state["step"] += 1
        snap = copy.deepcopy({k: v for k, v in self.state.items() if k != "optim"})
        self.force_commit = False
        self.commits.step_ended(durable, self.optimizer.cache.resident_bytes())

        def after() -> None:
            try:
                self.optimizer.wait_apply()
            finally:
                self.window.end_renewal()
                if self.next_rows is not None:
                    self.next_rows.end_deferred()
            tail = self.optimizer.take_tail() + self.optimizer.commit(durable)
            if not durable:
                self._land(tail)
                return
            snap["optim"] = copy.deepcopy(self.state["optim"])
            self._land_and_commit(tail, snap)
        self._commit_fut = self._committer.submit(after)

    def _end_step(self, durable: bool, flush: list) -> None:
        self.state["step"] += 1
        tail = self.optimizer.take_tail() + flush
        self.force_commit = False
        self.commits.step_ended(durable, self.optimizer.cache.resident_bytes())
        if not durable:  # the writes land meanwhile; a failed one raises at the next settle
            self._commit_fut = self._committer.submit(self._land, tail)
        elif self.optimizer.defer_writes:
            self._commit_fut = self._committer.submit(self._land_and_commit, tail, copy.deepcopy(self.state))
        else:
            self._land(tail)
            self._write_manifest()

    @property
    def step_commits(self) -> bool:
        """Does the step under way (or the last one, between steps) commit (--commit-every)?"""
        return self._durable

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
        # a rank on a GPU reduces it there (buckets.py): only the owner's sum comes to the host
        self._hand_over(name, g if self.dist is not None and self.reducer.on_device else to_host(g), held)

    def _hand_over(self, name: str, g: torch.Tensor, held: bool = False) -> None:
        """held: `g` takes the memory of the tied head's gradient, which the budget held through
        backward (Split.held_grad): it waits for the optimizer without taking the gradients' share."""
        if self.dist is not None:
            self.reducer.grad(name, g)  # summed over the ranks into the owner's optimizer
        else:
            self.optimizer.grad_ready(name, g, held=held)

    def _unchanged_weights(self, name: str, shard: int) -> None:
        """A fresh expert shard the optimizer left alone: its weights in the window stand."""
        self.window.unchanged(name, shard)

    def _owned(self, name: str) -> bool:
        """Does this process hold the parameter's master weights and moments?"""
        return self.dist is None or self.dist.owns(name)

    def wdtype(self, name: str) -> torch.dtype:
        """The dtype of a parameter's working weights: the run's, or fp32 where the family keeps it so."""
        return torch.float32 if name in self.kept32 else self.dtype

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
