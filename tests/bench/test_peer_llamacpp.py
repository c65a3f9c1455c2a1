"""benchmarks/peers/llamacpp.py's pieces that need no llama.cpp: finding a build, and the table."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peers import llamacpp  # noqa: E402


def _tool(d: Path, name: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text("#!/bin/sh\n")
    (d / name).chmod(0o755)


def test_find_takes_a_build_dir_and_reads_its_source_from_the_cmake_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_SOURCE", raising=False)
    with pytest.raises(FileNotFoundError, match="build_llama_cpp.sh"):
        llamacpp.find(tmp_path)
    _tool(tmp_path / "bin", "llama-bench")
    _tool(tmp_path / "bin", "llama-quantize")
    (tmp_path / "CMakeCache.txt").write_text("X:BOOL=ON\nCMAKE_HOME_DIRECTORY:INTERNAL=/src/llama.cpp\n")
    peer = llamacpp.find(tmp_path)
    assert peer.bench == tmp_path / "bin" / "llama-bench" and peer.source == Path("/src/llama.cpp")
    with pytest.raises(FileNotFoundError, match="convert_hf_to_gguf.py"):
        peer.converter()


def test_find_is_none_without_a_build_on_path(monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    assert llamacpp.find() is None


def test_side_by_side_gives_tierlm_over_llamacpp():
    rows = [{"format": "int8", "threads": 2,
             "llama.cpp": {"prefill_tok_s": 200.0, "prefill_tok_s_sd": 4.0, "decode_tok_s": 20.0, "decode_tok_s_sd": 0.5},
             "tierlm": {"prefill_tok_s": 100.0, "decode_tok_s": 25.0}}]
    head, _, row = llamacpp.side_by_side(rows)
    assert "llama.cpp prefill" in head
    assert row == "| int8 / Q8_0 | 2 | 200.0 ± 4.0 | 100.0 | 0.50x | 20.00 ± 0.50 | 25.00 | 1.25x |"
