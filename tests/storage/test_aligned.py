"""Buffers for direct I/O: 4 KiB-aligned always; from 2 MiB, on huge-page boundaries (where THP is on)."""
import subprocess
import sys

import pytest

from tierlm.storage import aligned


def test_small_buffers_are_page_aligned():
    for n in (1, 4096, 5000, (1 << 20) + 7):
        t = aligned.aligned_empty(n)
        assert t.data_ptr() % aligned.ALIGN == 0 and t.numel() == aligned.round_up(n)


@pytest.mark.skipif(not aligned.HUGE_BUFFERS, reason="transparent huge pages are off here")
def test_large_buffers_start_on_a_huge_page_and_cost_only_their_size():
    """In a fresh process: inside pytest's, what earlier tests left (threads, the kernel collapsing
    their pages into huge ones) grew RSS beside the buffers, by 22 MiB once in a full run."""
    code = ("from tierlm.storage import aligned\n"
            "def rss():\n"
            "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
            "size = 3 * aligned.HUGE + 5000\n"  # a tail past the last whole huge page
            "keep, before = [], rss()\n"
            "for _ in range(40):\n"
            "    t = aligned.aligned_empty(size)\n"
            "    assert t.data_ptr() % aligned.HUGE == 0 and t.numel() == aligned.round_up(size)\n"
            "    t.fill_(1)\n"
            "    keep.append(t)\n"
            "print(rss() - before, 40 * size)\n")
    grew, asked = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                          check=True).stdout.split())
    # the slack around each buffer is never faulted in as a huge page: RSS grows by the bytes asked
    assert grew < asked * 1.03, f"RSS grew {grew} for {asked} bytes asked"


def test_huge_buffers_can_be_switched_off():
    code = ("from tierlm.storage import aligned; t = aligned.aligned_empty(3 << 21); "
            "print(aligned.HUGE_BUFFERS, t.data_ptr() % 4096)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"TIERLM_HUGE_BUFFERS": "0", "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == ["False", "0"]
