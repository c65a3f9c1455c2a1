"""A gradient's fp32 norm without an fp32 copy of the whole gradient (tierlm.engine.grad_norm)."""
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.profiler import ProfilerActivity, profile

from tierlm.engine import grad_norm as GN


def test_up_to_a_chunk_the_bits_are_torchs():
    g = torch.randn(GN.CHUNK).to(torch.bfloat16)
    assert torch.equal(GN.grad_norm(g), torch.linalg.vector_norm(g.float(), 2))
    f = torch.randn(3 * GN.CHUNK + 7)
    assert torch.equal(GN.grad_norm(f), torch.linalg.vector_norm(f, 2))


def test_a_large_low_precision_gradient_is_reduced_in_pieces_without_a_full_copy():
    n = 6 * GN.CHUNK + 1234
    g = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).view(2, -1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = GN.grad_norm(g)
    biggest = max((e.self_cpu_memory_usage for e in prof.events()), default=0)
    assert biggest <= 4 * GN.CHUNK  # one piece's fp32 buffer; torch's upcast would be 4 * n bytes
    exact = g.double().norm().item()
    # torch sums a million fp32 squares to ~3e-5 of the exact norm; the pieces add no more
    assert got.dtype == torch.float32 and abs(got.item() - exact) <= 1e-4 * exact


def test_pieces_taken_ahead_give_the_same_bits():
    """A tied head's rows no token looks up are final early: the norms of the pieces inside them,
    taken then, complete to the very norm taken at once (optim_tail)."""
    n = 5 * GN.CHUNK + 99
    g = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    final = [(0, 2 * GN.CHUNK + 10), (3 * GN.CHUNK - 5, n)]  # pieces 0, 1, 3 (its end is n), 4, 5
    known = GN.piece_norms(g, final)
    assert sorted(known) == [0, 1, 3, 4, 5]
    assert torch.equal(GN.grad_norm(g, known), GN.grad_norm(g))
    assert not GN.chunked(torch.randn(n))  # an fp32 gradient's norm is one reduction: nothing ahead


def test_a_thread_keeps_its_pieces_buffer_from_call_to_call():
    """A buffer per call was fresh pages for every gradient, zeroed by the kernel (an MLP gradient of
    Qwen2.5-0.5B: 4.2 against 0.7 ms a call on a 2-vCPU AMD EPYC Zen 4). A thread's second call allocates no
    buffer; the optimizer's thread, taking norms beside the compute's, has its own."""
    g = torch.randn(2 * GN.CHUNK).to(torch.bfloat16)
    GN.grad_norm(g)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        GN.grad_norm(g)
    assert max((e.self_cpu_memory_usage for e in prof.events()), default=0) < 4 * GN.CHUNK
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(GN._buffer).result()
    assert other.data_ptr() != GN._buffer().data_ptr()
