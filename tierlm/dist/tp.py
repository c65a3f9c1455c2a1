"""Tensor-parallel inference: one model's decoder layers split across N processes (torch.distributed).

Megatron's split of a llama-style layer: q/k/v are column-split by heads (a rank holds heads/N query
heads and kv_heads/N key-value heads, so attention and its KV cache are local), o_proj is row-split;
the MLP's gate/up are column-split and down row-split. A row-split output is a partial sum, so one
all_reduce follows the attention and one the MLP. Embeddings, norms and the head are replicated:
every rank ends a forward with the same hidden states and logits.

Rank 0 leads: it runs the batcher (and the HTTP server) and broadcasts each step's (tokens, starts)
and each KV-slot move before doing them itself; the other ranks replay them (`follow`). Sampling
therefore happens once, on rank 0.

    torchrun --nproc-per-node 2 -m tierlm generate MODEL --prompt "..." --tp 2
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn

from ..hf.fields import overrides
from .group import _attempt_store

ATTN_COLS, ATTN_ROWS = ("q_proj", "k_proj", "v_proj"), "o_proj"
MLP_COLS, MLP_ROWS = ("gate_proj", "up_proj"), "down_proj"


def init(tp: int) -> tuple[int, int]:
    """(rank, world) of an initialised gloo group of `tp` processes (started by torchrun)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(f"--tp {tp} needs {tp} processes, one per shard: run it as "
                             f"`torchrun --nproc-per-node {tp} -m tierlm generate|serve MODEL --tp {tp}`")
        from datetime import timedelta

        # The same rendezvous as data parallelism: a prefix per torchrun attempt, so a restarted
        # group does not find the dead attempt's addresses.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        timeout = timedelta(seconds=300)
        dist.init_process_group("gloo", store=_attempt_store(rank, world, timeout), rank=rank,
                                world_size=world, timeout=timeout)
    world = dist.get_world_size()
    if world != tp:
        raise ValueError(f"--tp {tp} but torch.distributed has {world} processes; give "
                         f"--nproc-per-node {tp} to torchrun (or --tp {world})")
    return dist.get_rank(), world


class TensorParallel:
    def __init__(self, rank: int, world: int, group=None):
        self.rank, self.world, self.group = rank, world, group
        self.slices: dict[str, tuple[int, int, int]] = {}   # param name -> (dim, start, stop)
        self.zeroed: set[str] = set()                       # row-split biases other ranks must not add

    # ---- the split ------------------------------------------------------------------------
    def shard(self, model: nn.Module, layers: list[nn.Module], config) -> None:
        """Shrink the (meta) linear maps of every decoder layer to this rank's shard, remember which
        slice of each checkpoint tensor it holds, and add the all_reduce after attention and MLP."""
        names = {id(m): n for n, m in model.named_modules()}
        if overrides(config):
            raise ValueError(f"--tp splits layers of one shape; {config.model_type}'s layers differ "
                             f"({sorted({f for v in overrides(config).values() for f in v})} per layer): "
                             f"run it without --tp")
        heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        inter = config.intermediate_size
        for what, n in (("attention heads", heads), ("key-value heads", kv), ("MLP width", inter)):
            if n % self.world:
                raise ValueError(f"--tp {self.world} must divide the model's {what} ({n}); pick a divisor of {n}")
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if not all(isinstance(getattr(attn, a, None), nn.Linear) for a in (*ATTN_COLS, ATTN_ROWS)) or \
                    not all(isinstance(getattr(mlp, a, None), nn.Linear) for a in (*MLP_COLS, MLP_ROWS)):
                raise ValueError(f"--tp splits llama-style layers (self_attn.q/k/v/o_proj, mlp.gate/up/down_proj); "
                                 f"{type(layer).__name__} has another layout: run it without --tp")
            hd = attn.head_dim
            q_cols = heads // self.world * hd
            kv_cols = kv // self.world * hd
            self._split(names, attn.q_proj, 0, q_cols)
            self._split(names, attn.k_proj, 0, kv_cols)
            self._split(names, attn.v_proj, 0, kv_cols)
            self._split(names, attn.o_proj, 1, q_cols)
            for a in MLP_COLS:
                self._split(names, getattr(mlp, a), 0, inter // self.world)
            self._split(names, mlp.down_proj, 1, inter // self.world)
            attn.register_forward_hook(self._reduce)
            mlp.register_forward_hook(self._reduce)

    def _split(self, names: dict, lin: nn.Linear, dim: int, size: int) -> None:
        base = names[id(lin)]
        a = self.rank * size
        self.slices[f"{base}.weight"] = (dim, a, a + size)
        shape = list(lin.weight.shape)
        shape[dim] = size
        lin.weight = nn.Parameter(torch.empty(shape, device="meta", dtype=lin.weight.dtype), requires_grad=False)
        if dim == 0:
            lin.out_features = size
            if lin.bias is not None:
                self.slices[f"{base}.bias"] = (0, a, a + size)
                lin.bias = nn.Parameter(torch.empty(size, device="meta", dtype=lin.bias.dtype), requires_grad=False)
        else:
            lin.in_features = size
            if lin.bias is not None and self.rank:
                self.zeroed.add(f"{base}.bias")  # the sum of N partial outputs must add it once

    def _reduce(self, module, args, out):
        t = out[0] if isinstance(out, tuple) else out
        dist.all_reduce(t, group=self.group)
        return out

    def read(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (the whole tensor when it is replicated)."""
        if name in self.zeroed:
            return torch.zeros_like(t)
        if name not in self.slices:
            return t
        dim, a, b = self.slices[name]
        return t.narrow(dim, a, b - a).contiguous()

    def local_config(self, config):
        """The config as one rank sees it: its heads (the KV cache holds only those)."""
        c = copy.deepcopy(config)
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        c.head_dim = hd
        c.num_attention_heads = config.num_attention_heads // self.world
        c.num_key_value_heads = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // self.world
        return c

    # ---- leader and followers ------------------------------------------------------------
    def _send(self, msg) -> None:
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.group)

    def lead_step(self, tokens, starts) -> None:
        if self.rank == 0:
            self._send(("step", tokens, starts))

    def lead_move(self, src: int, dst: int, length: int) -> None:
        if self.rank == 0:
            self._send(("move", src, dst, length))

    def lead_stop(self) -> None:
        if self.rank == 0:
            self._send(("stop",))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def follow(self, engine) -> None:
        """A follower's loop: replay rank 0's steps and slot moves until it stops."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            msg = box[0]
            if msg[0] == "step":
                engine.step(msg[1], msg[2])
            elif msg[0] == "move":
                engine.move_slot(*msg[1:])
            else:
                return
