"""Which optimizer-state shards the state cache keeps between steps: those updated last.

A cache filled in arrival order holds the first shards a step updates (the head's, the last
layers'). Then the step ends with the last shards' reads, compute done and the drive reading and
writing their states one after the other (TinyLlama 1x128 under 4 GiB, a 2-vCPU Zen 4 VM: the embedding's
0.92 GB of reads took the last 2.1 s of an 11.7 s step). Cached instead, the last shards update as
soon as their gradients arrive and their writes land early in the next forward, which only reads
weights and left the drive ~40% idle; the first shards' reads overlap backward's start, the head's
backward among it, when the drive was idle (steps 0.95x, docs/benchmarks.md).
"""
from __future__ import annotations


def last_that_fit(seq: list, size_of, capacity: int) -> set:
    """The longest suffix of `seq` (shard keys in update order) whose sizes sum within `capacity`."""
    room, keep = capacity, set()
    for nk in reversed(seq):
        if nk in keep:
            continue
        size = size_of(nk)
        if size > room:
            break
        room -= size
        keep.add(nk)
    return keep
