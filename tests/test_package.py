"""What importing tierlm sets up for the process: large tensors on transparent huge pages."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# 64 MiB tensor written through, then the process's anonymous huge pages (kB)
PROBE = r"""
import tierlm, torch, re
x = torch.empty(16 << 20)
x.fill_(1.0)
rollup = open("/proc/self/smaps_rollup").read()
print(int(re.search(r"AnonHugePages:\s+(\d+)", rollup).group(1)))
"""


def _huge_kb(thp_env: str | None) -> int:
    """The probe's huge pages, THP_MEM_ALLOC_ENABLE unset (None) or set to `thp_env`."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if thp_env is not None:
        env["THP_MEM_ALLOC_ENABLE"] = thp_env
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _thp_mode() -> str:
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)
    except (OSError, AttributeError):
        return "absent"


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_large_tensors_are_on_huge_pages():
    assert _huge_kb(None) >= 32 << 10  # most of the 64 MiB


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only where huge pages are asked for can they be declined")
def test_a_user_who_turns_it_off_is_heard():
    assert _huge_kb("0") == 0


def _tamed(env_value: str | None) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "TIERLM_MALLOC"}
    if env_value is not None:
        env["TIERLM_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", "import tierlm; print(tierlm.MALLOC_TAMED)"], env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_glibc_malloc_settings_are_ours_unless_asked_for_plain():
    """Budgets need large blocks returned on free (tierlm's settings); the in-memory reference of
    `bench train` is plain PyTorch, on glibc's own."""
    assert _tamed(None)
    assert not _tamed("glibc")


def test_bench_trains_in_memory_reference_runs_on_glibcs_own_malloc(monkeypatch, tmp_path):
    from tierlm.train import bench_train as bt
    seen = []

    def fake_run(cmd, check=False, env=None, **kw):
        seen.append((cmd, env))
        raise SystemExit  # the first run is all this test looks at
    monkeypatch.setattr(bt.subprocess, "run", fake_run)
    monkeypatch.setattr(bt, "_inmemory_fits", lambda model: (True, 0))
    from tierlm.hf import checks  # no model directory here: its checks pass
    monkeypatch.setattr(checks, "check_model_dir", lambda path: {})
    monkeypatch.setattr(checks, "load_tokenizer", lambda path: None)
    with pytest.raises(SystemExit):
        bt.bench_train("model", "data.txt", "1GiB", 2, str(tmp_path), ["--precision", "fp32", "--device", "cpu"])
    cmd, env = seen[0]
    assert "tierlm.train.inmemory" in cmd and env["TIERLM_MALLOC"] == "glibc"


def test_every_file_the_kernels_compile_from_is_package_data():
    """A wheel (a non-editable install) ships the C sources and the header they share: without
    gemv.h the kernels fail to build there and decode falls back to PyTorch's products."""
    import tomllib
    from fnmatch import fnmatch

    from tierlm.infer import native

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["tierlm.infer"]
    base = Path(native.__file__).parent
    for f in native.SRC + native.HEADERS:
        rel = f.relative_to(base).as_posix()
        assert any(fnmatch(rel, g) for g in globs), f"{rel} is not in tierlm.infer's package-data {globs}"
