"""Storage tier: the only code that moves bytes between host memory and the NVMe directory."""
from .pool import Buffer, BudgetError, HostBufferPool
from .store import CorruptionError, Loaded, Record, StorageError, TensorStore

__all__ = ["Buffer", "BudgetError", "HostBufferPool", "CorruptionError", "Loaded", "Record", "StorageError", "TensorStore"]
