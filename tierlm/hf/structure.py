"""The model skeleton: every parameter on no memory, every buffer real, parameters grouped in blocks.

A block is the unit the engine streams: the input embeddings, each decoder layer, and the head
(final norm + lm_head). The block's parameters are materialised only while it is in the window.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .fields import shrunk


@contextlib.contextmanager
def _params_on_meta():
    """Create parameters on `meta` but buffers (rotary inv_freq, masks) with their real values.

    `torch.device("meta")` would also make the buffers meta, and their values are computed in
    the modules' constructors, not stored in checkpoints.
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def causal_lm(model: nn.Module) -> nn.Module:
    """Names the loss of a causal LM whose class name transformers maps to none (GPT2LMHeadModel):
    it would fall back to the same ForCausalLM loss, with a warning on the first loss of every
    process (`loss_type=None ... unrecognized`), in the middle of a command's output."""
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return model


def fixed_params_to_buffers(model: nn.Module) -> list[str]:
    """Make the parameters the model's modules keep fixed (`requires_grad=False`: Ernie 4.5 MoE's,
    Laguna's and AFMoE's router score-correction biases) persistent buffers under the same names:
    fine-tuning never updates them (torch's AdamW skips a parameter without a gradient), and as
    buffers they are read from the checkpoint and saved back as they are (hf.names.load_buffers,
    saved_buffers), beside the trained parameters. A parameter on `meta` becomes zeros, for
    load_buffers to fill. Returns their names."""
    fixed = [n for n, p in model.named_parameters() if not p.requires_grad]
    for name in fixed:
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        p = mod._parameters.pop(attr)
        value = torch.zeros(p.shape, dtype=p.dtype) if p.device.type == "meta" else p.detach()
        mod.register_buffer(attr, value, persistent=True)
    return fixed


def empty_model(config, dtype: torch.dtype | None = None) -> nn.Module:
    """An HF causal LM for `config` whose parameters take no memory. With `dtype`, made as
    transformers' load in that dtype makes it: its constructors run under that default dtype (a
    table XGLM computes for its positions is then in it, as the activations it is added to), and
    what the family keeps in fp32 there (kept_fp32: a router's correction bias) is fp32."""
    from transformers import AutoModelForCausalLM

    kw = {"dtype": dtype} if dtype is not None else {}
    with _params_on_meta():
        model = causal_lm(AutoModelForCausalLM.from_config(config, **kw))
    if dtype is not None:
        wide = kept_fp32(model, dtype, buffers=True)
        for n, b in model.named_buffers():
            if n in wide and b.is_floating_point():
                mod, _, attr = n.rpartition(".")
                model.get_submodule(mod)._buffers[attr] = b.float()
    model.train()
    return model


def kept_fp32(model: nn.Module, dtype: torch.dtype, buffers: bool = False) -> set[str]:
    """The parameters (with `buffers`, the buffers) transformers keeps in fp32 when it loads the
    model in `dtype` (the family's `_keep_in_fp32_modules_strict` in bf16: a mixture's router
    weights and correction bias, attention sinks), by its own dtype plan and pattern matching."""
    if dtype == torch.float32:
        return set()
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return set()
    from transformers.core_model_loading import build_glob_alternation
    alt, group, _ = build_glob_alternation(list(plan))
    out = set()
    named = list(model.named_parameters()) + (list(model.named_buffers()) if buffers else [])
    for n, _ in named:
        hit = alt.search(n)
        if hit and plan[group[hit.lastgroup]] == torch.float32:
            out.add(n)
    return out


def cast(model: nn.Module, dtype: torch.dtype, device=None) -> nn.Module:
    """`model.to(device, dtype)`, but what transformers keeps in fp32 when it loads the model in
    `dtype` stays fp32 (kept_fp32: Inkling 2's routers, whose forward multiplies fp32 by them)."""
    wide = kept_fp32(model, dtype, buffers=True)
    made: dict[int, torch.Tensor] = {}  # a tensor two modules share (a tied head) stays one
    for n, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        mod, _, attr = n.rpartition(".")
        owner = model.get_submodule(mod)
        if id(t) not in made:
            dt = (torch.float32 if n in wide else dtype) if t.is_floating_point() else t.dtype
            moved = t.detach().to(device=device or t.device, dtype=dt)
            made[id(t)] = nn.Parameter(moved, requires_grad=t.requires_grad) if attr in owner._parameters else moved
        if attr in owner._parameters:
            owner._parameters[attr] = made[id(t)]
        else:
            owner._buffers[attr] = made[id(t)]
    return model


@dataclass
class Block:
    index: int                  # position in forward order
    name: str                   # "embed", "layers.3", "head"
    kind: str                   # "embed" | "layer" | "head"
    module: nn.Module | None    # the decoder layer, for kind == "layer"
    uses: list[str] = field(default_factory=list)   # parameters it needs resident to run
    owns: list[str] = field(default_factory=list)   # parameters whose update it triggers


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name, list) of the model's decoder layers: the list of num_hidden_layers entries, those of
    transformers' layer class (GradientCheckpointingLayer) first; else the first list of one class
    whose length divides that count (LongCat-Flash counts each layer's two attention sublayers,
    its cache's layers: with one decoder layer, the sublayers' list of 2 matches the count exactly,
    and only the layer class tells the decoder layers from them)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    n = model.config.num_hidden_layers
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and len(mod)]
    layered = [(name, mod) for name, mod in lists if all(isinstance(x, GradientCheckpointingLayer) for x in mod)]
    for candidates in (layered, lists):
        for name, mod in candidates:
            if len(mod) == n:
                return name, mod
        for name, mod in candidates:
            if n % len(mod) == 0 and len({type(x) for x in mod}) == 1:
                return name, mod
    raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__}")


@dataclass(frozen=True)
class LayerTrace:
    """What a forward of a two-layer tiny copy of the family shows (trace_layers)."""
    early: tuple[str, ...] = ()     # modules (not embeddings) whose weights run before the first layer


_TRACES: dict[str, LayerTrace] = {}


def trace_layers(config) -> LayerTrace:
    """Run a tiny copy of the family (hf.fields.shrunk, two layers) forward with hooks. Kept per config: every engine a process builds for the same model asks. A family
    with no tiny copy, or whose tiny forward fails, shows nothing."""
    key = config.to_json_string()
    if key not in _TRACES:
        _TRACES[key] = _trace(config)
    return _TRACES[key]


def weights_before_layers(config) -> list[str]:
    """Modules other than embeddings whose weights a forward uses before the first decoder layer
    (BLOOM's embedding LayerNorm, OPT's project_in, ModernBERT's embedding norm). An embedding's
    backward needs no weight, so the engine streams it; these are used first and needed again at
    the very end of backward, so the engine holds them through the step (discover_blocks puts them
    in the embedding's block)."""
    return list(trace_layers(config).early)


def _trace(config) -> LayerTrace:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        tiny = shrunk(config, layers=2)
        with torch.random.fork_rng(devices=[]):
            m = AutoModelForCausalLM.from_config(tiny)
        _, layers = find_layers(m)
    except Exception:  # noqa: BLE001 -- no tiny copy of this family: nothing known, nothing refused
        return LayerTrace()
    seen, early = {"layers": False}, []

    def note(mod, name):
        if not seen["layers"] and any(p is not None for p in mod._parameters.values()) \
                and not isinstance(mod, nn.Embedding):
            early.append(name)

    layer_mods = {id(x) for x in layers.modules()}
    handles = [layers[0].register_forward_pre_hook(lambda *_: seen.update(layers=True))]
    handles += [mod.register_forward_pre_hook(lambda mod, _a, n=name: note(mod, n))
                for name, mod in m.named_modules() if id(mod) not in layer_mods]
    try:
        with torch.no_grad():
            m(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    except Exception:  # noqa: BLE001 -- as above
        return LayerTrace()
    finally:
        for h in handles:
            h.remove()
    return LayerTrace(tuple(early))


def discover_blocks(model: nn.Module, early: list[str] | tuple = ()) -> tuple[list[Block], dict[str, nn.Parameter]]:
    """Group the model's parameters into embed / layer / head blocks in forward order. The direct
    parameters of the modules named in `early` (weights_before_layers) go to the embed block;
    those of any other module outside the layers but an embedding, to the head.

    Returns the blocks and the canonical name -> Parameter map (tied parameters appear once, under
    the name `named_parameters()` gives them first: the input embedding's).
    """
    layers_name, layers = find_layers(model)
    params = dict(model.named_parameters())  # de-duplicated: tied weights once
    canon = {id(p): n for n, p in params.items()}
    embed = Block(0, "embed", "embed", None)
    blocks = [embed]
    for i, layer in enumerate(layers):
        blocks.append(Block(i + 1, f"layers.{i}", "layer", layer))
    head = Block(len(blocks), "head", "head", None)
    blocks.append(head)

    prefix = layers_name + "."
    for full, p in model.named_parameters(remove_duplicate=False):
        name = canon[id(p)]
        if full.startswith(prefix):
            b = blocks[1 + int(full[len(prefix):].split(".")[0])]
        else:
            owner = full.rsplit(".", 1)[0]
            mod = model.get_submodule(owner)
            b = embed if isinstance(mod, nn.Embedding) or owner in early else head
        if name not in b.uses:
            b.uses.append(name)
        if full == name:
            b.owns.append(name)
    return blocks, params


def module_param_slots(model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """canonical parameter name -> every (module, attribute) that holds it (two for tied weights)."""
    params = dict(model.named_parameters())
    canon = {id(p): n for n, p in params.items()}
    slots: dict[str, list] = {n: [] for n in params}
    for mod_name, mod in model.named_modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                slots[canon[id(p)]].append((mod, attr))
    return slots


def experts_modules(layer: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """(name, module, its stacked parameters) of each experts module in a decoder layer (or a
    model): a module transformers' experts implementations dispatch for
    (`use_experts_implementation`), whose parameters of `num_experts` rows along the first dimension
    are the experts'."""
    out = []
    for name, mod in layer.named_modules():
        if not (hasattr(mod, "_is_expert_parallel") and isinstance(getattr(mod, "num_experts", None), int)):
            continue
        stacked = [a for a, p in mod._parameters.items()
                   if p is not None and p.dim() >= 2 and p.shape[0] == mod.num_experts]
        if stacked:
            out.append((name, mod, stacked))
    return out


def stacked_experts(model: nn.Module) -> dict[str, int]:
    """canonical parameter name -> its number of experts, for every stacked experts' parameter
    ([experts, ...]: Mixtral's `mlp.experts.gate_up_proj`, gpt-oss's biases too)."""
    canon = {id(p): n for n, p in model.named_parameters()}
    return {canon[id(mod._parameters[a])]: mod.num_experts
            for _, mod, attrs in experts_modules(model) for a in attrs}

