"""Buffers for direct I/O: 4 KiB-aligned always; from 2 MiB, on huge-page boundaries (where THP is on)."""
import subprocess
import sys

import pytest

from tierlm.storage import aligned


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_small_buffers_are_page_aligned():
    for n in (1, 4096, 5000, (1 << 20) + 7):
        t = aligned.aligned_empty(n)
        assert t.data_ptr() % aligned.ALIGN == 0 and t.numel() == aligned.round_up(n)


@pytest.mark.skipif(not aligned.HUGE_BUFFERS, reason="transparent huge pages are off here")
def test_large_buffers_start_on_a_huge_page_and_cost_only_their_size():
    size = 3 * aligned.HUGE + 5000  # a tail past the last whole huge page
    keep, before = [], _rss()
    for _ in range(40):
        t = aligned.aligned_empty(size)
        assert t.data_ptr() % aligned.HUGE == 0 and t.numel() == aligned.round_up(size)
        t.fill_(1)
        keep.append(t)
    # the slack around each buffer is never faulted in as a huge page: RSS grows by the bytes asked
    assert _rss() - before < 40 * size * 1.03


def test_huge_buffers_can_be_switched_off():
    code = ("from tierlm.storage import aligned; t = aligned.aligned_empty(3 << 21); "
            "print(aligned.HUGE_BUFFERS, t.data_ptr() % 4096)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"TIERLM_HUGE_BUFFERS": "0", "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == ["False", "0"]
