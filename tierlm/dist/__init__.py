"""Data parallelism over torch.distributed: every rank streams the whole model on its slice of the
global batch; each parameter's optimizer state lives on one owner rank (see docs/distributed.md)."""
from .group import Dist, from_env, in_torchrun, owners_by_bytes

__all__ = ["Dist", "from_env", "in_torchrun", "owners_by_bytes"]
