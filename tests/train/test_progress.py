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
                    activations="keep", timeline_step=2, commit_every="1")
    assert len(windows) == 4
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert start == end  # the next window starts where this one ended
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    total = windows[-1][1]["bytes_written"] - windows[0][0]["bytes_written"]
    assert sum(r["ssd_write_bytes"] for r in rows) == total
    # fp32 master, m and v of every parameter, 12 bytes each, every step (a commit every step: in
    # between, what the cache keeps is not written): all four steps' writes
    # but the part of the last one's that lands after its row
    params = sum(p.numel() for p in _model_params(model))
    assert 3 * 12 * params < total <= 4 * 12 * params


def _model_params(model):
    from safetensors.torch import load_file
    return load_file(str(model / "model.safetensors")).values()


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text.append(s)

    def flush(self):
        pass


def test_a_bar_only_where_a_terminal_shows_it(tmp_path):
    """A bar's frames are carriage returns: on a terminal they redraw one line, in a file each
    stays between the log lines. Files, pipes, closed streams and wrappers without isatty: lines."""
    assert P.use_bar(_Stream(tty=True))
    assert not P.use_bar(_Stream(tty=False))
    assert not P.use_bar(object())
    with open(tmp_path / "log", "w") as f:
        assert not P.use_bar(f)
    closed = open(tmp_path / "log")
    closed.close()
    assert not P.use_bar(closed)

    from tqdm import tqdm
    tty = _Stream(tty=True)
    bar = P.make_bar(5, 1, tty)
    assert isinstance(bar, tqdm)
    bar.update(1)
    bar.close()
    assert any("\r" in s for s in tty.text)  # the bar drew itself on the terminal
    assert isinstance(P.make_bar(5, 1, _Stream(tty=False)), P._Lines)


def test_a_redirected_run_logs_one_plain_line_per_step(tmp_path):
    """`tierlm finetune ... > log 2>&1`: no bar frames (no carriage return) in either stream, one
    line per step, in order."""
    import subprocess
    import sys
    model = tmp_path / "model"
    init_model(model, make_config("llama", None, {"layers": 2, "hidden": 64}))
    data = tmp_path / "data.txt"
    data.write_text("\n".join(f"Record {i}: a line of the log." for i in range(200)))
    r = subprocess.run([sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(data),
                        "--output", str(tmp_path / "run"), "--cpu-mem", "256MiB", "--seq-len", "24",
                        "--steps", "3", "--precision", "fp32", "--activations", "keep", "--timeline-step", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "\r" not in r.stdout and "\r" not in r.stderr
    steps = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["1/3", "2/3", "3/3"]
