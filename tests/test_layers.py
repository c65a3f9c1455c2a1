"""The one-way layers of docs/design.md, as import-linter checks them: pyproject.toml's
[tool.importlinter] contract, imports inside functions included."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return subprocess.run([exe, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_layers_go_one_way():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "1 kept, 0 broken" in out.stdout


def test_an_import_up_the_layers_breaks_the_contract(tmp_path):
    """The contract can fail: a copy of the package where plan imports the engine is refused."""
    shutil.copytree(ROOT / "tierlm", tmp_path / "tierlm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bad = tmp_path / "tierlm" / "plan" / "budget.py"
    bad.write_text(bad.read_text() + "\n\ndef _up():\n    from ..engine import engine  # noqa: F401\n")
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                          "from importlinter.cli import lint_imports_command; lint_imports_command()", "--no-cache"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "tierlm.plan is not allowed to import tierlm.engine" in out.stdout, out.stdout[-3000:]
