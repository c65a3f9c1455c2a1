"""A closed engine leaves nothing behind: the Python API can train again and again in one process."""
import gc
import weakref

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig

from .test_exactness import batches


def test_a_closed_engine_is_collected(make_model_dir, tmp_path):
    """The gradient hooks on the parameters referred to the engine, a cycle through tensors that
    the collector does not traverse: every closed engine stayed alive with its model and buffers
    (fails without removing the hooks at close)."""
    model_dir, _ = make_model_dir("llama")
    x = batches(1)[0]
    eng = Engine.from_pretrained(model_dir, EngineConfig(nvme_dir=str(tmp_path / "nv"), cpu_mem="1GiB",
                                                         optim=AdamWConfig(lr=1e-3)))
    try:
        eng.backward(eng.forward(x, labels=x).loss)
        eng.step()
    finally:
        eng.close()
    ref = weakref.ref(eng)
    del eng
    gc.collect()
    assert ref() is None
