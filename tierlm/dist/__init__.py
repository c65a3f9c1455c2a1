"""Distributed execution over torch.distributed: tensor-parallel inference (tp.py) and data-parallel
training: every rank streams the whole model on its slice of the global batch; each parameter's
optimizer state lives on one owner rank (group.py, grads.py, state.py; see docs/distributed.md)."""
from .group import Dist, from_env, in_torchrun, owners_by_bytes

__all__ = ["Dist", "from_env", "in_torchrun", "owners_by_bytes"]
