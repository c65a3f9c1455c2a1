"""The engine's exports (engine/export.py): what is released before one, and that steps after it
still give the same bits."""
import torch

from tests.engine.test_exactness import batches
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig


def test_released_step_memory_is_handed_back_and_later_steps_read_it_from_disk(make_model_dir, tmp_path):
    """release_step_memory (before the final export) empties the state cache and the pools' free
    buffers; steps after it read the dropped states from disk and give the same bits."""
    model_dir, _ = make_model_dir("llama")
    data = batches(4)
    out = {}
    for release in (True, False):
        eng = Engine.from_pretrained(model_dir, EngineConfig(
            nvme_dir=str(tmp_path / f"nvme-{release}"), cpu_mem="1GiB", precision="bf16",
            optim=AdamWConfig(lr=1e-3, weight_decay=0.1)))
        try:
            for i, x in enumerate(data):
                eng.backward(eng.forward(x, labels=x).loss)
                eng.step()
                if release and i == 1:
                    assert eng.cache_pool.used_bytes > 0
                    eng.release_step_memory()
                    assert eng.cache_pool.resident_bytes == 0 and not eng.optimizer.cache.resident
                    for pool in (eng.window_pool, eng.opt_pool):
                        assert pool.resident_bytes == pool.used_bytes  # no free buffers kept
            out[release] = {n: eng.master(n) for n in eng.names}
        finally:
            eng.close()
    for name, m in out[False].items():
        assert torch.equal(out[True][name], m), name
