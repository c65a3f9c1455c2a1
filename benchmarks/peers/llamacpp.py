"""llama.cpp as a measured peer: find a build, turn a HF model directory into GGUF files (its own
converter, then llama-quantize), and measure a GGUF with llama-bench.

Optional, like every peer: nothing in tierlm needs it. benchmarks/peers/build_llama_cpp.sh builds
one outside the repo; `find()` takes that build directory (--llama-cpp DIR) or llama-bench on PATH.

The formats line up with tierlm's weights: bf16 <-> BF16 (the checkpoint's own bits, as tierlm's
bf16 keeps them), int8 <-> Q8_0 (8 bits and a scale per 32 weights; tierlm: per 128), int4 <-> Q4_0
(4 bits and a scale per 32; tierlm: per 128).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# tierlm's weight format -> llama.cpp's GGUF type
FORMATS = {"bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}


@dataclass(frozen=True)
class LlamaCpp:
    bench: Path             # llama-bench
    quantize: Path          # llama-quantize
    source: Path | None     # the source tree (convert_hf_to_gguf.py and its gguf-py), if known

    def converter(self) -> Path:
        if self.source is None or not (self.source / "convert_hf_to_gguf.py").is_file():
            raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py not found: set LLAMA_CPP_SOURCE to its source "
                                    "tree (a build by benchmarks/peers/build_llama_cpp.sh names it in CMakeCache.txt)")
        return self.source / "convert_hf_to_gguf.py"


def source_version(peer: LlamaCpp) -> str:
    """Where the build's source came from and its ggml version (a shallow checkout, as in the
    llama-cpp-python sdist, gives every build the build number 1: the commit and this identify it)."""
    if peer.source is None:
        return "source unknown"
    cm = peer.source / "ggml" / "CMakeLists.txt"
    parts = {}
    if cm.is_file():
        for line in cm.read_text(errors="replace").splitlines():
            for k in ("MAJOR", "MINOR", "PATCH"):
                if line.strip().startswith(f"set(GGML_VERSION_{k} "):
                    parts[k] = line.split()[1].rstrip(")")
    ggml = ".".join(parts[k] for k in ("MAJOR", "MINOR", "PATCH")) if len(parts) == 3 else "?"
    return f"ggml {ggml}, source {peer.source}"


def _source_of(build: Path) -> Path | None:
    """The source tree a CMake build directory was configured from (its CMakeCache.txt says)."""
    if os.environ.get("LLAMA_CPP_SOURCE"):
        return Path(os.environ["LLAMA_CPP_SOURCE"])
    cache = build / "CMakeCache.txt"
    if cache.is_file():
        for line in cache.read_text(errors="replace").splitlines():
            if line.startswith("CMAKE_HOME_DIRECTORY:"):
                return Path(line.split("=", 1)[1])
    return None


def find(build_dir: str | os.PathLike | None = None) -> LlamaCpp | None:
    """The llama.cpp build in `build_dir` (its bin/ or the directory itself holding llama-bench), else
    llama-bench on PATH; None where there is neither (the caller runs without the peer)."""
    if build_dir is not None:
        root = Path(build_dir)
        for d in (root / "bin", root):
            if (d / "llama-bench").is_file() and (d / "llama-quantize").is_file():
                return LlamaCpp(d / "llama-bench", d / "llama-quantize", _source_of(root))
        raise FileNotFoundError(f"no llama-bench and llama-quantize in {root} or {root / 'bin'}: build them with "
                                "benchmarks/peers/build_llama_cpp.sh")
    bench, quant = shutil.which("llama-bench"), shutil.which("llama-quantize")
    if not bench or not quant:
        return None
    bench = Path(bench).resolve()
    return LlamaCpp(bench, Path(quant).resolve(), _source_of(bench.parent.parent))


# The converter recognises a BPE tokenizer by the hash of how it splits a test text, and refuses
# one it has not seen. Models tierlm creates carry a byte-level BPE whose split is Qwen2's
# (tierlm.hf.tokenizer), so an unrecognised one is named "qwen2", the pre-tokenizer llama.cpp then
# applies; the tokenizer does not change a timing, only which text the GGUF could encode.
_CONVERT = """
import runpy, sys
sys.path.insert(0, {src!r})
sys.path.insert(1, {src!r} + "/gguf-py")
from conversion import base
_pre = base.TextModel.get_vocab_base_pre
def _or_qwen2(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        return "qwen2"
base.TextModel.get_vocab_base_pre = _or_qwen2
sys.argv = [{conv!r}] + {args!r}
runpy.run_path({conv!r}, run_name="__main__")
"""


def _has_merges(tokenizer_json: Path) -> bool:
    model = json.loads(tokenizer_json.read_text()).get("model", {})
    return model.get("type") != "BPE" or bool(model.get("merges"))


def ensure_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """The converter reads the tokenizer from the model directory, and llama.cpp refuses a BPE
    without merges (tierlm's bytes-only tokenizer): where the model has none, or that one, a BPE
    trained on the standard library's docstrings (the demo's local corpus) is written there. The
    weights and config are not touched; the tokenizer changes no timing."""
    if (model_dir / "tokenizer.model").is_file() or (
            (model_dir / "tokenizer.json").is_file() and _has_merges(model_dir / "tokenizer.json")):
        return
    from tierlm.demo import stdlib_corpus
    from tierlm.hf.tokenizer import make_tokenizer
    corpus = stdlib_corpus(model_dir.parent / "tokenizer-corpus.txt", max_bytes=1_000_000)
    make_tokenizer(model_dir, [str(corpus)], vocab_size=vocab_size)


def _run(cmd: list[str], log: Path | None = None, wrap=None) -> str:
    """Run `cmd` (through `wrap(cmd)` where given, e.g. into a memory cgroup); its stdout."""
    p = subprocess.run(wrap(cmd) if wrap else cmd, capture_output=True, text=True)
    if log is not None:
        log.write_text(p.stdout + p.stderr)
    if p.returncode:
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-25:])
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{tail}")
    return p.stdout


def convert(peer: LlamaCpp, model_dir: Path, out: Path, outtype: str = "bf16") -> list[str]:
    """model_dir (HF) -> out (GGUF, `outtype` f16 / bf16) by llama.cpp's own converter. Returns the command."""
    conv = peer.converter()
    args = [str(model_dir), "--outfile", str(out), "--outtype", outtype]
    _run([sys.executable, "-c", _CONVERT.format(src=str(conv.parent), conv=str(conv), args=args)],
         out.with_suffix(".convert.log"))
    return ["python", str(conv), *args]


def quantize(peer: LlamaCpp, src: Path, dst: Path, gguf_type: str, threads: int) -> list[str]:
    """src (a 16-bit GGUF) -> dst in `gguf_type` (Q8_0, Q4_0, ...) by llama-quantize."""
    cmd = [str(peer.quantize), str(src), str(dst), gguf_type, str(threads)]
    _run(cmd, dst.with_suffix(".quantize.log"))
    return cmd


def gguf_files(peer: LlamaCpp, model_dir: Path, work: Path, formats: list[str], threads: int,
               log=print) -> tuple[dict[str, Path], list[list[str]]]:
    """One GGUF per tierlm format (FORMATS), from model_dir: the 16-bit one by the converter, the
    others quantized from it. Files already in `work` are kept. Returns {format: path} and the commands."""
    work.mkdir(parents=True, exist_ok=True)
    base = work / "model-BF16.gguf"
    cmds = []
    if not base.is_file():
        log(f"converting {model_dir} to {base}")
        cmds.append(convert(peer, model_dir, base, "bf16"))
    files = {}
    for fmt in formats:
        t = FORMATS[fmt]
        files[fmt] = base if t == "BF16" else work / f"model-{t}.gguf"
        if not files[fmt].is_file():
            log(f"quantizing to {t}")
            cmds.append(quantize(peer, base, files[fmt], t, threads))
    return files, cmds


def _bench(peer: LlamaCpp, gguf: Path, args: list[str], wrap=None) -> tuple[dict, list[str]]:
    cmd = [str(peer.bench), "-m", str(gguf), "-o", "json", *args]
    rows = json.loads(_run(cmd, wrap=wrap))
    if len(rows) != 1:
        raise RuntimeError(f"llama-bench gave {len(rows)} results for one test: {' '.join(cmd)}")
    return rows[0], cmd


def measure(peer: LlamaCpp, gguf: Path, prompt_len: int, tokens: int, threads: int, reps: int = 3,
            extra: tuple[str, ...] = (), wrap=None) -> dict:
    """Prefill and decode tokens/s of one GGUF by llama-bench, as tierlm's engine is measured: prefill
    of a `prompt_len`-token prompt, then `tokens` decoded after that prompt (-d: the KV cache holds
    it). Means over `reps` runs after llama-bench's warm-up, with their spread and the commands.
    `extra`: more llama-bench arguments (e.g. -lm none: no mmap); `wrap`: how each command is started (e.g.
    benchmarks/peers/memlimit.MemoryLimit.command, inside a memory cgroup)."""
    common = ["-t", str(threads), "-r", str(reps), *extra]
    pp, cmd_p = _bench(peer, gguf, ["-p", str(prompt_len), "-n", "0", *common], wrap)
    tg, cmd_d = _bench(peer, gguf, ["-p", "0", "-n", str(tokens), "-d", str(prompt_len), *common], wrap)
    return {"engine": "llama.cpp", "gguf": gguf.name, "type": pp.get("model_type"), "threads": threads,
            "prompt_len": prompt_len, "tokens": tokens,
            "prefill_tok_s": pp["avg_ts"], "prefill_tok_s_sd": pp["stddev_ts"],
            "decode_tok_s": tg["avg_ts"], "decode_tok_s_sd": tg["stddev_ts"],
            "build": f"{pp.get('build_commit')} (build {pp.get('build_number')})", "cpu_info": pp.get("cpu_info"),
            "backends": pp.get("backends"), "commands": [cmd_p, cmd_d]}


def _rate(r: dict, key: str, digits: int) -> str:
    sd = r.get(key + "_sd")
    return f"{r[key]:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def side_by_side(rows: list[dict]) -> list[str]:
    """Markdown: per format and thread count, both engines' rates and tierlm / llama.cpp. Each row:
    {"format", "threads", "llama.cpp": measure()'s dict, "tierlm": {prefill_tok_s, decode_tok_s, [..._sd]}}."""
    out = ["| format (tierlm / llama.cpp) | threads | llama.cpp prefill tok/s | tierlm prefill tok/s | tierlm / llama.cpp "
           "| llama.cpp decode tok/s | tierlm decode tok/s | tierlm / llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, t = r["llama.cpp"], r["tierlm"]
        out.append(f"| {r['format']} / {FORMATS[r['format']]} | {r['threads']} "
                   f"| {_rate(p, 'prefill_tok_s', 1)} | {_rate(t, 'prefill_tok_s', 1)} "
                   f"| {t['prefill_tok_s'] / p['prefill_tok_s']:.2f}x "
                   f"| {_rate(p, 'decode_tok_s', 2)} | {_rate(t, 'decode_tok_s', 2)} "
                   f"| {t['decode_tok_s'] / p['decode_tok_s']:.2f}x |")
    return out


def system_info(peer: LlamaCpp, gguf: Path) -> dict:
    """Which paths llama.cpp takes here: the CPU features ggml was built with and detects (the
    build script's llama-system-info: `CPU : AVX2 = 1 | AVX512 = 1 | ...`), and the layouts
    llama-bench -v reports it repacked this GGUF's weights into (e.g. q4_0_8x8; none: products
    read the file's blocks as they are)."""
    out = {}
    tool = peer.bench.parent / "llama-system-info"
    if tool.is_file():
        out["features"] = subprocess.run([str(tool)], capture_output=True, text=True).stdout.strip()
    p = subprocess.run([str(peer.bench), "-m", str(gguf), "-p", "8", "-n", "0", "-r", "1", "-t", "1", "-v",
                        "--no-warmup"], capture_output=True, text=True)
    kinds = sorted({ln.rsplit(" with ", 1)[1].strip() for ln in (p.stdout + p.stderr).splitlines()
                    if "repack tensor" in ln and " with " in ln})
    out["repacked"] = kinds
    return out


__all__ = ["FORMATS", "LlamaCpp", "convert", "ensure_tokenizer", "find", "gguf_files", "measure", "quantize",
           "side_by_side", "source_version", "system_info"]
