"""One reserved region that a pool's buffers are placed in, so that a freed buffer's pages serve the
next buffer of any size instead of going back to the OS.

A pool that keeps freed buffers by exact size must allocate afresh whenever the sizes asked for
change, and the kernel zeroes every fresh page. Qwen2.5-0.5B
at 1x32 tokens under --cpu-mem 4GiB allocated ~1.0 GiB of weight-window buffers and 0.45-0.65 GiB
of optimizer buffers afresh every step: the tied embedding (259 MiB of the window's 345) pushed the
layers' buffers out once a step, and the optimizer's shards come in a dozen sizes.

Free space is a sorted list of segments, each marked dirty (its pages may be resident: it was handed
out since it was last discarded) or clean. A buffer goes to the free run that needs the fewest
clean pages, then the tightest fit. `discard` hands dirty pages back (MADV_DONTNEED) when the pool
must shrink its resident bytes.
"""
from __future__ import annotations

import bisect

import torch

from .aligned import ALIGN, _madvise, aligned_empty, round_up

MADV_DONTNEED = 4


class Arena:
    def __init__(self, capacity: int):
        self.size = round_up(max(int(capacity), ALIGN))
        self.region = aligned_empty(self.size)  # virtual until first touched
        self._base = self.region.data_ptr()
        self._array = self.region.numpy()
        self._segs: list[list] = [[0, self.size, False]]  # [start, end, dirty], sorted, disjoint
        self.dirty = 0  # free bytes whose pages may be resident

    def place(self, size: int, avoid: tuple[int, int] | None = None) -> tuple[int, torch.Tensor] | None:
        """Room for `size` bytes (a multiple of ALIGN) in one free run outside `avoid`, or None."""
        segs = self._segs
        if avoid is not None:
            lo, hi = avoid
            segs = [c for a, b, d in segs for c in ([a, min(b, lo), d], [max(a, hi), b, d]) if c[1] > c[0]]
        # (plain ints, no tuple a run: this runs for every buffer a step)
        best, best_clean, best_len = -1, 0, 0
        i = 0
        n = len(segs)
        while i < n:
            j, end = i, segs[i][1]
            while j + 1 < n and segs[j + 1][0] == end:  # a run: adjacent segments
                j += 1
                end = segs[j][1]
            start = segs[i][0]
            if end - start >= size:
                clean = self._clean_in(segs, i, start + size)
                if best < 0 or clean < best_clean or (clean == best_clean and end - start < best_len):
                    best, best_clean, best_len = start, clean, end - start
            i = j + 1
        if best < 0:
            return None
        start = best
        self._take(start, start + size)
        # A storage of its own (numpy's slice keeps the region alive): code that tells tensors
        # apart by their storage (the saved-tensor hooks' parameter lookup) sees one per buffer.
        return start, torch.from_numpy(self._array[start:start + size])

    def free(self, start: int, size: int) -> None:
        self._insert(start, start + size, True)

    def discard(self, nbytes: int) -> int:
        """Hand `nbytes` (rounded up to pages) of dirty free pages back to the OS, from the ends of
        the largest dirty segments; returns how many were handed back."""
        need = round_up(max(int(nbytes), 0))
        done = 0
        for seg in sorted((s for s in self._segs if s[2]), key=lambda s: s[0] - s[1]):
            if done >= need:
                break
            b = seg[1]
            a = max(seg[0], b - (need - done))
            _madvise(self._base + a, b - a, MADV_DONTNEED)
            self._insert(a, b, False)
            done += b - a
        return done

    def cheapest_range(self, size: int, movable: dict[int, tuple]) -> tuple[list[int], tuple[int, int]] | None:
        """The buffers to free so that `size` contiguous bytes are free, and the range they and
        the free pages there span: `movable` maps a buffer's start to (its end, its cost, a
        number); buffers not in it stay. The range whose costliest buffer costs least (then whose
        costs sum least) wins. None: no such range."""
        items = [(a, b, None) for a, b, _ in self._segs] + [(a, b, c) for a, (b, c) in movable.items()]
        items.sort(key=lambda x: x[0])
        best = None
        i = 0
        while i < len(items):
            # a run of free or movable items, each starting where the last ended
            j = i
            while j + 1 < len(items) and items[j + 1][0] == items[j][1]:
                j += 1
            run = items[i:j + 1]
            lo = 0
            for hi in range(len(run)):
                while lo < hi and run[hi][1] - run[lo + 1][0] >= size:
                    lo += 1  # the window still covers `size` without its first item
                if run[hi][1] - run[lo][0] < size:
                    continue
                costs = [c for _, _, c in run[lo:hi + 1] if c is not None]
                span = (run[lo][0], run[hi][1])
                if not costs:
                    return [], span  # free already
                key = (max(costs), sum(costs))
                if best is None or key < best[0]:
                    best = (key, [a for a, _, c in run[lo:hi + 1] if c is not None], span)
            i = j + 1
        return None if best is None else (best[1], best[2])

    @staticmethod
    def _clean_in(segs: list, i: int, stop: int) -> int:
        clean = 0
        for a, b, dirty in segs[i:]:
            if a >= stop:
                break
            if not dirty:
                clean += min(b, stop) - a
        return clean

    def _take(self, a: int, b: int) -> None:
        """Remove [a, b) from the free segments."""
        segs = self._segs
        k = bisect.bisect_left(segs, a, key=lambda s: s[0])
        if k > 0 and segs[k - 1][1] > a:
            k -= 1
        j = k
        pieces = []
        while j < len(segs) and segs[j][0] < b:
            s0, s1, dirty = segs[j]
            if dirty:
                self.dirty -= min(s1, b) - max(s0, a)
            if s0 < a:
                pieces.append([s0, a, dirty])
            if s1 > b:
                pieces.append([b, s1, dirty])
            j += 1
        if j > k:
            segs[k:j] = pieces

    def _insert(self, a: int, b: int, dirty: bool) -> None:
        """Mark [a, b) free with this dirtiness (replacing what covered it), merging alike neighbours."""
        self._take(a, b)
        k = bisect.bisect_left(self._segs, a, key=lambda s: s[0])
        self._segs.insert(k, [a, b, dirty])
        if dirty:
            self.dirty += b - a
        if k + 1 < len(self._segs) and self._segs[k + 1][0] == b and self._segs[k + 1][2] == dirty:
            self._segs[k][1] = self._segs.pop(k + 1)[1]
        if k > 0 and self._segs[k - 1][1] == a and self._segs[k - 1][2] == dirty:
            self._segs[k - 1][1] = self._segs.pop(k)[1]
