"""oneDNN's kernel caches are bounded from tierlm's import on (tierlm/kernel_cache.py): products of
ever new shapes (a mixture of experts' per-expert products) do not grow the process without end."""
import os
import subprocess
import sys

from tierlm.kernel_cache import KERNEL_CACHE_BYTES, KERNEL_CACHE_ENTRIES

# bf16 products of 160 row counts: each builds a new product where oneDNN runs them (AVX512-BF16,
# AMX: ~0.56 MiB each, 90 MiB kept by the libraries' default caches); elsewhere no cache grows.
GROWTH = """
import tierlm, torch
w = torch.randn(256, 256, dtype=torch.bfloat16)
torch.mm(torch.randn(1, 256, dtype=torch.bfloat16), w)
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * __import__('os').sysconf('SC_PAGE_SIZE')
before = rss()
for m in range(2, 162):
    torch.mm(torch.randn(m, 256, dtype=torch.bfloat16), w)
print(rss() - before)
"""


def _run(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True)
    return out.stdout.split()[-1]


def test_importing_tierlm_bounds_the_caches_and_keeps_a_users_choice():
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    code = "import os, tierlm; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'] + ',' + os.environ['LRU_CACHE_CAPACITY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.split()[-1] == f"{KERNEL_CACHE_ENTRIES},{KERNEL_CACHE_ENTRIES}"
    assert _run(code, ONEDNN_PRIMITIVE_CACHE_CAPACITY="7", LRU_CACHE_CAPACITY="9") == "7,9"


def test_products_of_new_shapes_do_not_grow_the_process_past_the_bound():
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", GROWTH], env=env, check=True, capture_output=True, text=True)
    grew = int(out.stdout.split()[-1])
    assert grew <= KERNEL_CACHE_BYTES + (8 << 20), f"RSS grew {grew / 2**20:.0f} MiB over 160 new product shapes"
