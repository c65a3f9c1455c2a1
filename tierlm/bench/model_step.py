"""The model's own training step, timed: what `tierlm plan --hardware this` predicts a step from.

Two probes, the first that can run is used: the step through the engine itself (a two-layer copy of
the model fine-tuned by `tierlm.Engine`, so that the optimizer, checksums and writes share the cores
as in a run), and the bare layer (the family's decoder layer from transformers, forward and
backward). Where neither runs, the planner interpolates the reference layers of `measure.bench_layer`.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import torch

from ..engine.engine import Engine, EngineConfig
from ..engine.head_loss import causal_lm_loss
from ..heap import MIN_COMPUTE_SHARE, HeapGuard
from ..engine.optim_types import AdamWConfig
from ..hf.fields import put
from ..hf.structure import find_layers
from ..plan import budget as B
from ..plan.budget import chunk_tokens
from . import measure

MODEL_STEP_S = 4.0        # one layer's timed step at most about this (fewer rows of the run's length)
MODEL_MAX_PARAMS = 2e9    # beyond: building the probe model takes longer than the plan is worth
# More rounds than `repeats` while they take less than MODEL_PROBE_S: on a 2-core machine shared
# with other work (load 6-7), one llama layer's forward + backward at 512 tokens took 0.18-2.1 s in
# ten rounds, and the run's own layers 0.09-0.13 s: the best of five can miss the quiet moments.
MODEL_PROBE_S = 10.0
MODEL_MAX_ROUNDS = 25


def model_step_key(config, tokens: int, seq: int, dtype: torch.dtype) -> str:
    """What a model-step probe depends on: the family, the shapes, the micro-batch, dtype and threads."""
    d = config.to_dict()
    shape = {k: d.get(k) for k in ("model_type", "hidden_size", "n_embd", "intermediate_size", "n_inner",
                                    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                    "hidden_act", "tie_word_embeddings", "sliding_window",
                                    # a mixture's experts: how many, how wide, how many a token
                                    "num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
                                    "num_experts_per_tok")}
    return (json.dumps(shape, sort_keys=True) + f"|tokens={tokens}|seq={seq}|{str(dtype).removeprefix('torch.')}"
            f"|threads={torch.get_num_threads()}")


def bench_model_step(config, tokens: int, seq: int, dtype: torch.dtype, repeats: int = 5) -> dict | None:
    """Seconds of a training micro-batch through the model's own code, split into one decoder
    layer's forward + backward and the rest (embedding, final norm, head and loss), on torch's
    threads (the run's), in the run's compute dtype and sequence length: what `finetune` computes,
    not a generic layer at a reference width.

    The model family's code is built from `config` by transformers (as the engine builds it), with
    one decoder layer. A whole step (the engine's path: head and loss in chunks where the engine
    chunks them, head_loss) is timed, and its layer alone, called again with the arguments the
    model's own forward gave it (captured by a hook: any family's signature); the rest is the
    difference. Timing the layer directly, not as the difference of two depths, keeps the noise
    of a shared machine out of the number the plan multiplies by the layer count (two depths, 3
    rounds, on a 2-core machine shared with other work, once put a layer at 6x what the run's own
    layers took).

    At the run's rows per micro-batch where one layer's step takes at most MODEL_STEP_S and the
    step fits a quarter of the free memory; else fewer rows of the run's length, scaled per token
    (the attention's cost per token depends on the length, kept). None where even one row does
    not fit, or the model is too large to build quickly: the planner then interpolates between
    bench compute's reference layers and says so.

    Each part's best of `repeats` rounds or more (MODEL_PROBE_S), interleaved. The steps run as the engine's do: with freed
    blocks kept in the heap for reuse (HeapGuard); under tierlm's import settings every transient
    tensor would be fresh pages zeroed by the kernel, a cost the step it predicts does not pay."""

    per_row = B.layer_activation_bytes(config, seq, dtype) + B.logits_bytes(config, seq, dtype)
    built = _one_layer_model(config, dtype, per_row)
    if built is None:
        return None
    model, room = built
    guard = HeapGuard(1 << 50, MIN_COMPUTE_SHARE)
    try:
        rows = _rows_to_time(model, config, seq, dtype, max(1, tokens // seq), int(room // per_row))
        whole = _model_step(model, config, seq, dtype, rows)
        best = _best_of_rounds({"model": whole, "layer": _layer_step(model, whole)}, repeats)
    finally:
        guard.close()
    probed = rows * seq
    scale = tokens / probed  # the run's tokens per micro-batch
    return {"layer_s": best["layer"] * scale, "rest_s": max(best["model"] - best["layer"], 0.0) * scale,
            "tokens": tokens, "probed_tokens": probed, "seq": seq, "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "model_s": best["model"] * scale, "model_type": config.model_type}


def _param_count(cfg) -> int:
    """Parameters of the model `cfg` builds, counted without allocating them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())


def _one_layer_model(config, dtype: torch.dtype, per_row: int):
    """The family's model with one decoder layer, random weights in `dtype`, in training mode, and
    the memory a probe may use for rows beside it (a quarter of what is free); None where it is
    too large to build quickly or not one row of `per_row` bytes fits."""
    import copy

    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    put(cfg, "layers", 1)  # any family's field; a layer pattern (layer_types) cut to match
    n = _param_count(cfg)
    elem = torch.empty((), dtype=dtype).element_size()
    room = psutil.virtual_memory().available // 4 - n * (4 + 2 * elem)  # the fp32 init, weights, gradients
    if n > MODEL_MAX_PARAMS or room < per_row:
        return None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.train()
    return model, room


def _model_step(model, config, seq: int, dtype: torch.dtype, rows: int):
    """A training step of `rows` random rows of `seq` tokens through the whole model, its head and
    loss in chunks where the engine chunks them (head_loss)."""

    head = model.get_output_embeddings()
    plain_head = type(head) is torch.nn.Linear and not getattr(config, "final_logit_softcapping", None)
    ids = torch.randint(0, config.vocab_size, (rows, seq))
    chunk = chunk_tokens(rows * seq, config.vocab_size, dtype) if plain_head else None

    def step():
        model.zero_grad(set_to_none=True)
        if chunk:
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
            loss = causal_lm_loss(hidden, head, ids, chunk)
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return step


def _layer_step(model, whole):
    """The decoder layer's own forward + backward, on the arguments the model's forward passed it
    in `whole` (captured by a hook: any family's signature)."""

    layer = find_layers(model)[1][0]
    got = {}

    def hook(mod, args, kwargs):
        got["args"], got["kwargs"] = args, kwargs
    h = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        whole()
    finally:
        h.remove()
    x, args, kwargs = _detached(got["args"], got["kwargs"])

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(*args, **kwargs)
        (y[0] if isinstance(y, tuple) else y).float().sum().backward()
    return step


def _detached(args: tuple, kwargs: dict):
    """A layer call's arguments cut from the graph that made them, its hidden states a leaf that
    takes a gradient: (the hidden states, args, kwargs)."""
    args, kwargs = list(args), dict(kwargs)
    if args:
        x = args[0].detach().clone().requires_grad_(True)
        args[0] = x
    else:
        x = kwargs["hidden_states"].detach().clone().requires_grad_(True)
        kwargs["hidden_states"] = x
    kwargs = {k: (v.detach() if isinstance(v, torch.Tensor) else
                  tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in v) if isinstance(v, tuple) else v)
              for k, v in kwargs.items()}
    return x, args, kwargs


def _rows_to_time(model, config, seq: int, dtype: torch.dtype, rows_want: int, rows_room: int) -> int:
    """The run's rows per micro-batch, or fewer where one layer's step would pass MODEL_STEP_S or
    the rows' memory the room: one row's layer step timed to tell."""
    one = _layer_step(model, _model_step(model, config, seq, dtype, 1))
    one()  # first-call allocations and kernel selection: not what a row costs
    t_row = measure.best_seconds(one, 3)
    return max(1, min(rows_want, rows_room, int(MODEL_STEP_S / max(t_row, 1e-6))))


def _best_of_rounds(steps: dict, repeats: int) -> dict[str, float]:
    """Each step's best seconds over `repeats` interleaved rounds, or more while they take less
    than MODEL_PROBE_S (at most MODEL_MAX_ROUNDS), after a warm-up at the timed shape."""
    for st in steps.values():
        st()  # warm-up at the timed shape
    best = dict.fromkeys(steps, float("inf"))
    t0, rounds = time.perf_counter(), 0
    while rounds < repeats or (time.perf_counter() - t0 < MODEL_PROBE_S and rounds < MODEL_MAX_ROUNDS):
        for k, st in steps.items():
            best[k] = min(best[k], measure.best_seconds(st, 1))
        rounds += 1
    return best


ENGINE_PROBE_LAYERS = 2   # the probe model's depth: one layer beside the head, one beside the embedding
# The first steps pay for first reads, kernel selection and the heap and caches filling: on a 2-core
# machine a two-layer probe's steps 2-4 still took 1.2-1.6x the steady ones (as a run's steps 2-3
# do), so the median is of the steps after ENGINE_PROBE_WARMUP.
ENGINE_PROBE_STEPS = 8
ENGINE_PROBE_BUDGET = "4GiB"  # the probe engine's --cpu-mem where the task gives none
ENGINE_PROBE_WARMUP = 3


def engine_step_key(config, tokens: int, seq: int, dtype: torch.dtype, cpu_mem: int | None, clip: str,
                    state_cache: bool = True) -> str:
    """What an engine-step probe depends on: the model-step key's, the budget, clipping and state
    cache, and the steps it times (a probe cached with fewer warm-up steps is measured again)."""
    return (f"engine|{model_step_key(config, tokens, seq, dtype)}|cpu_mem={cpu_mem}|clip={clip}"
            f"|state_cache={state_cache}|steps={ENGINE_PROBE_STEPS}-{ENGINE_PROBE_WARMUP}")


def bench_engine_step(config, tokens: int, seq: int, dtype: torch.dtype, directory: str | os.PathLike,
                      cpu_mem: int | None = None, clip: str = "on", state_cache: bool = True, *,
                      layers: int = ENGINE_PROBE_LAYERS, steps: int = ENGINE_PROBE_STEPS,
                      warmup: int = ENGINE_PROBE_WARMUP) -> dict | None:
    """Seconds of a training step as `tierlm finetune` runs it, from a copy of the model's family
    and shapes with `layers` decoder layers (random weights) driven by the engine itself, at the
    run's micro-batch, sequence length, dtype, threads and budget: split into one decoder layer's
    compute and the rest of the step.

    Why the engine and not the bare layer: in a run the layer's forward and backward share the
    cores with the optimizer updating the layer before it, the store's checksums and writes, the
    gradient hooks and weight installs; on a 2-core machine the engine's own per-layer profile came
    out 1.5-2x a bare layer's forward + backward at the same shapes. Here those costs are in the
    number, measured where they happen.

    The step is timed as finetune times it (from the end of one step to the end of the next, the
    deferred commit's writes landing in the next step; the activation planner's one-off drive probe
    left out). The per-layer time is the engine's own profile of the first layer (forward +
    backward, waits excluded; it runs beside the next layer's update, as every layer but the last
    does in a deeper model); the rest (embedding, head and loss, the last layer's extra beside the
    head's update, commit, waits) is the step less `layers` of it. Medians over the steps after the
    first `warmup`; `read_bytes`, what a step read from the drive (state the budget did not cache): the CPU
    work of those reads is in the step, the planner adds only the reads a deeper model makes beyond.
    None where the probe model is too large to build quickly."""
    import gc
    import statistics

    model = _probe_model(config, layers)
    if model is None:
        return None
    rows = max(1, tokens // seq)
    clear_stale_probes(directory)
    root = Path(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=directory))
    (root / "pid").write_text(str(os.getpid()))  # whose it is, for clear_stale_probes
    ecfg = _engine_config(root, dtype, cpu_mem, clip, state_cache, rows, seq)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (rows, seq), generator=g) for _ in range(steps + 1)]
    eng = None
    try:
        eng = Engine.from_model(model, ecfg)  # a budget it refuses raises: the caller falls back
        del model
        gc.collect()
        gc.freeze()  # as finetune: a full collection walking the run held the GIL from the I/O threads
        step_s, layer_s, read = _run_steps(eng, batches, steps)
    finally:
        gc.unfreeze()
        if eng is not None:
            eng.close()
        shutil.rmtree(root, ignore_errors=True)
    step, layer = statistics.median(step_s[warmup:]), statistics.median(layer_s[warmup:])
    return {"layer_s": layer, "rest_s": max(step - layers * layer, 0.0), "step_s": step, "layers": layers,
            "tokens": tokens, "probed_tokens": rows * seq, "seq": seq, "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "model_type": config.model_type, "source": "engine",
            "steps": len(step_s) - warmup, "read_bytes": int(statistics.median(read[warmup:]))}


PROBE_PREFIX = ".tierlm-engine-probe-"


def clear_stale_probes(directory) -> None:
    """Delete the probe stores in `directory` whose process is gone. A probe deletes its own store
    when it ends, but a killed one (SIGKILL, or `timeout`'s SIGTERM) cannot, and a large model's
    store holds its whole training state (LongCat-Flash's tiny default: 11-15 GB each)."""
    for d in Path(directory or tempfile.gettempdir()).glob(PROBE_PREFIX + "*"):
        try:
            pid = int((d / "pid").read_text())
        except (OSError, ValueError):
            continue  # not marked: made by an older tierlm, or being made now
        if not psutil.pid_exists(pid):
            shutil.rmtree(d, ignore_errors=True)


def _probe_model(config, layers: int):
    """The family's model with `layers` decoder layers and random weights (seeded), or None where
    it is too large to build quickly."""
    import copy

    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    put(cfg, "layers", layers)
    if _param_count(cfg) > MODEL_MAX_PARAMS:
        return None
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _engine_config(root: Path, dtype: torch.dtype, cpu_mem: int | None, clip: str, state_cache: bool,
                   rows: int, seq: int):
    """The probe engine's settings: the run's precision, budget (4 GiB where none is given),
    clipping and state cache, its activations kept, its store under `root`."""

    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    # clipping on (or redo): the gradients are saved for the exact redo, as in the run; the limit is
    # out of reach so that random weights' large norms do not redo every step (the planner adds the
    # redo where the task clips every step)
    optim = AdamWConfig(max_grad_norm=None if clip == "off" else 1e30)
    return EngineConfig(nvme_dir=str(root / "nvme"), cpu_mem=cpu_mem or ENGINE_PROBE_BUDGET, precision=precision,
                        activations="keep", optim=optim, state_cache=state_cache, tokens_per_micro_batch=rows * seq,
                        micro_batch_size=rows)


def _run_steps(eng, batches: list, steps: int) -> tuple[list[float], list[float], list[int]]:
    """`steps` training steps through `eng`, timed as finetune times them: per step its seconds
    (end of one step to the end of the next, the activation planner's drive probe left out), the
    first layer's forward + backward from the engine's profile, and the bytes read from the drive."""
    step_s, layer_s, read = [], [], []
    t0, r0 = time.perf_counter(), eng.store.stats.snapshot()["bytes_read"]
    for i in range(steps):
        loss = eng.forward(batches[i], labels=batches[i]).loss
        eng.expect(batches[i + 1])
        eng.backward(loss)
        eng.finish()
        now = time.perf_counter()
        first = eng.acts.cur[min(eng.acts.cur)]
        step_s.append(now - t0)
        layer_s.append(first["fwd"] + first["bwd"])
        r1 = eng.store.stats.snapshot()["bytes_read"]
        read.append(r1 - r0)
        t0, r0 = now, r1
        probed = eng.acts.measure_s
        eng.commit()
        t0 += eng.acts.measure_s - probed
    return step_s, layer_s, read
