"""The per-step metrics: every byte the store moves between the first step and the last row belongs
to exactly one step's row."""
import json

import tierlm
from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config
from tierlm.train import progress as P


def test_step_windows_are_contiguous_and_the_rows_add_up(tmp_path, monkeypatch):
    """The deferred commit's last writes land after a row is written: they count in the next row,
    and drawing a timeline between two steps (step 2 here) loses none of them."""
    model = tmp_path / "model"
    init_model(model, make_config("llama", None, {"layers": 2, "hidden": 64}))
    data = tmp_path / "data.txt"
    data.write_text("\n".join(f"Record {i}: the row counts every byte." for i in range(200)))
    windows = []
    step = P.Progress.step

    def record(self, *a):
        windows.append((a[-2], a[-1]))  # io0, io
        return step(self, *a)
    monkeypatch.setattr(P.Progress, "step", record)
    tierlm.finetune(model=str(model), data=str(data), output=str(tmp_path / "run"), cpu_mem="256MiB",
                    seq_len=24, batch_size=2, steps=4, lr=1e-3, precision="fp32", max_grad_norm=0,
                    activations="keep", timeline_step=2)
    assert len(windows) == 4
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert start == end  # the next window starts where this one ended
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    total = windows[-1][1]["bytes_written"] - windows[0][0]["bytes_written"]
    assert sum(r["ssd_write_bytes"] for r in rows) == total
    # fp32 master, m and v of every parameter, 12 bytes each, every step: all four steps' writes
    # but the part of the last one's that lands after its row
    params = sum(p.numel() for p in _model_params(model))
    assert 3 * 12 * params < total <= 4 * 12 * params


def _model_params(model):
    from safetensors.torch import load_file
    return load_file(str(model / "model.safetensors")).values()
