"""Measuring the memory promises from outside the process that makes them."""
import functools
import subprocess
import sys

# The kernel's high-water mark of a process's own memory map. (ru_maxrss is carried across exec,
# so a child of this large pytest process would report pytest's size as its own.)
PEAK = "int([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]) * 1024"


def library_peak(family: str | None = None, tokenizer=None, config: dict | None = None) -> int:
    """Peak RSS of a fresh process with torch, transformers and the model family's code (llama, or
    `family` of tests/families.py: a mixture of experts loads more of transformers), after one tiny
    bf16 forward and backward: the libraries' own footprint, which `--cpu-mem` does not count.
    tokenizer: a model directory whose tokenizer the CLI loads (tokenizers and the chat template's
    jinja2 add ~5 MiB of their own). config: the family's tiny config fields, for a family not in
    tests/families.py."""
    import json

    if family is None:
        build = ("from transformers import LlamaConfig\n"
                 "cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, "
                 "num_key_value_heads=2, vocab_size=512)\n")
    else:
        from .families import FAMILIES
        kw = FAMILIES[family] if config is None else config
        build = ("import json\nfrom transformers import AutoConfig\n"
                 f"cfg = AutoConfig.for_model({family!r}, **json.loads({json.dumps(kw)!r}))\n")
    if tokenizer is not None:
        build += f"transformers.AutoTokenizer.from_pretrained({str(tokenizer)!r})\n"
    code = ("import torch, transformers\n" + build +
            "from transformers import AutoModelForCausalLM\n"
            "m = AutoModelForCausalLM.from_config(cfg).bfloat16()\n"
            "ids = torch.randint(0, min(cfg.vocab_size, 512), (1, 8)); m(input_ids=ids, labels=ids).loss.backward()\n"
            f"print({PEAK})")
    return _peak_of(code)


@functools.lru_cache(maxsize=None)
def _peak_of(code: str) -> int:
    """Once a session for each program: the same libraries and model code load the same pages, and
    each measurement is a fresh interpreter (~5 s on a 2-vCPU VM)."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1])


def held_now() -> int:
    """This process's RSS now, to pass as an in-process engine's `library_rss`: its --cpu-mem then
    counts only what the engine adds. (library_rss=0 counted the whole pytest process, whose RSS
    drifts past 1 GiB late in a full run and refused 1 GiB budgets at random; the library baseline
    that the CLI measures, a fresh process's, is smaller still than a long pytest process's.)"""
    from tierlm import rss
    rss.trim()
    return rss.current_rss()
