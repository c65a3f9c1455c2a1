"""Every `tierlm VERB ...` command the docs show names a verb that exists and only its flags.

The commands are read from README.md and docs/*.md: fenced code blocks (lines joined at a trailing
backslash) and inline code spans in the prose. A command starts at `tierlm`, `python -m tierlm`,
`torchrun ... -m tierlm` (after an optional `$ ` prompt, environment assignments or a wrapper such
as `flock FILE`), and ends at a shell operator (`&&`, `|`, `;`) or a comment. Its verb (and sub-verb,
as in `tierlm bench io`) and every `--flag` are checked against `tierlm.cli.build_parser()`, the
parser the command line uses; placeholders (`MODEL`, `...`) are skipped. No subprocess runs and
building the parser imports no torch, so this takes well under a second.
"""
from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tierlm.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
# Options whose value is itself a command line of another verb's flags: (verb, option) -> verb.
NESTED_FLAGS = {("bench", "--finetune-args"): "finetune"}
WRAPPERS = {"flock", "timeout", "time", "sudo", "nohup", "env", "exec"}
FLAG = re.compile(r"^--?[A-Za-z][\w-]*(=.*)?$")
FENCE = re.compile(r"^(\s*)(```|~~~)")


@dataclass
class Command:
    where: str   # "file:line"
    text: str


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def commands_in(text: str, name: str) -> list[Command]:
    """The candidate command lines of one markdown text: code block lines and inline code spans."""
    out, prose, fence, block = [], [], None, []
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, block = m.group(2), []
            prose.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
                out += _joined(block, name)
            else:
                block.append((i, line))
            prose.append("")
            continue
        prose.append(line)
    # Inline spans may wrap across lines of one paragraph, never across a blank line.
    flat = "\n".join(prose)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", flat):
        if "\n\n" not in m.group(1):
            line = flat.count("\n", 0, m.start()) + 1
            out.append(Command(f"{name}:{line}", " ".join(m.group(1).split())))
    return out


def _joined(block: list[tuple[int, str]], name: str) -> list[Command]:
    out, start, parts = [], None, []
    for i, line in block:
        start = start or i
        s = line.rstrip()
        if s.endswith("\\"):
            parts.append(s[:-1])
            continue
        parts.append(s)
        out.append(Command(f"{name}:{start}", " ".join(p.strip() for p in parts)))
        start, parts = None, []
    if parts:
        out.append(Command(f"{name}:{start}", " ".join(p.strip() for p in parts)))
    return out


def _tokens(text: str) -> list[str]:
    try:
        lex = shlex.shlex(text, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        return list(lex)
    except ValueError:  # an unbalanced quote in prose: words will do
        return text.split()


def _segments(tokens: list[str]) -> list[list[str]]:
    segs, cur = [], []
    for t in tokens:
        if t and set(t) <= set(";&|"):
            segs.append(cur)
            cur = []
        else:
            cur.append(t)
    return segs + [cur]


def tierlm_args(seg: list[str]) -> list[str] | None:
    """The arguments after `tierlm` if this shell segment runs tierlm, else None."""
    i = 0
    while i < len(seg) and (seg[i] == "$" or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", seg[i])):
        i += 1
    seg = seg[i:]
    if not seg:
        return None
    if seg[0] == "tierlm":
        return seg[1:]
    runner = Path(seg[0]).name
    if runner.startswith("python") or runner == "torchrun" or seg[0] in WRAPPERS:
        for j in range(1, len(seg)):
            if seg[j] == "tierlm" and (seg[j - 1] == "-m" or seg[0] in WRAPPERS):
                return seg[j + 1:]
    return None


def _placeholder(tok: str) -> bool:
    return tok in ("...", "…") or bool(re.match(r"^[A-Z][A-Z0-9_]*$", tok)) or "<" in tok


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a.choices
    return None


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def check_args(args: list[str], parser: argparse.ArgumentParser, path: str = "tierlm") -> list[str]:
    """Problems with one command's arguments (empty when it names a real verb and real flags)."""
    verbs = _subparsers(parser)
    if verbs is not None:
        if not args or args[0].startswith("-"):
            return _check_flags(args, parser, path)
        verb = args[0]
        if verb.endswith(":") or _placeholder(verb):
            return []  # program output (`tierlm generate: ...`) or `tierlm VERB`
        if verb not in verbs:
            return [f"`{path} {verb}`: no such verb (verbs: {', '.join(sorted(verbs))})"]
        return check_args(args[1:], verbs[verb], f"{path} {verb}")
    first = next((a for a in parser._actions if not a.option_strings and a.dest != "help"), None)
    if first is not None and first.choices and args and not args[0].startswith("-") \
            and not _placeholder(args[0]) and args[0] not in first.choices:
        return [f"`{path} {args[0]}`: not one of {', '.join(sorted(first.choices))}"]
    return _check_flags(args, parser, path)


def _check_flags(args: list[str], parser: argparse.ArgumentParser, path: str) -> list[str]:
    known, problems = _options(parser), []
    for i, raw in enumerate(args):
        if raw == "--":
            break
        tok = raw.lstrip("[").rstrip("]")
        if not FLAG.match(tok):
            continue
        flag = tok.split("=", 1)[0]
        if flag not in known:
            problems.append(f"`{path}` has no flag {flag}")
            continue
        nested = NESTED_FLAGS.get((path.split()[-1], flag))
        value = tok.split("=", 1)[1] if "=" in tok else (args[i + 1] if i + 1 < len(args) else "")
        if nested and value:
            sub = _subparsers(build_parser())[nested]
            problems += [f"{p} (inside {flag})" for p in _check_flags(_tokens(value), sub, f"tierlm {nested}")]
    return problems


def problems_in(text: str, name: str, parser: argparse.ArgumentParser) -> tuple[int, list[str]]:
    """(commands checked, problems) of one markdown text."""
    n, problems = 0, []
    for cmd in commands_in(text, name):
        for seg in _segments(_tokens(cmd.text)):
            args = tierlm_args(seg)
            if args is None:
                continue
            n += 1
            problems += [f"{cmd.where}: {p}: {cmd.text}" for p in check_args(args, parser)]
    return n, problems


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def test_every_tierlm_command_in_the_docs_names_real_verbs_and_flags(parser):
    total, problems = 0, []
    for f in doc_files():
        n, p = problems_in(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)), parser)
        total, problems = total + n, problems + p
    assert not problems, "\n".join(problems)
    assert total >= 50, f"only {total} tierlm commands found in the docs: is the extraction broken?"


def test_each_user_page_is_linked_from_the_index():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    missing = [f.name for f in (ROOT / "docs").glob("*.md") if f.name != "README.md" and f"({f.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_and_images_resolve():
    """Every relative link names a file that exists (and a heading of it, after #); every image in
    docs/ is shown by some page."""
    problems, shown = [], set()
    for f in doc_files():
        text = re.sub(r"```.*?```", "", f.read_text(encoding="utf-8"), flags=re.S)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target, _, anchor = m.group(1).partition("#")
            if re.match(r"^[a-z]+:", target):
                continue  # http:, mailto:
            path = (f.parent / target).resolve() if target else f
            shown.add(path)
            if not path.exists():
                problems.append(f"{f.relative_to(ROOT)}: {m.group(1)}: no such file")
            elif anchor and path.suffix == ".md":
                heads = {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)}
                if anchor not in heads:
                    problems.append(f"{f.relative_to(ROOT)}: {m.group(1)}: no such heading")
    unshown = [p.name for p in (ROOT / "docs").glob("*.png") if p.resolve() not in shown]
    assert not problems, "\n".join(problems)
    assert not unshown, f"images no page shows: {unshown}"


@pytest.mark.parametrize("doc, expected", [
    ("```bash\ntierlm finetune MODEL --data x --made-up-flag 3\n```", "has no flag --made-up-flag"),
    ("Run `tierlm generate MODEL\n--prompt hi --nonsense`.", "has no flag --nonsense"),
    ("```\n$ tierlm finetune m \\\n    --lr 1e-4 \\\n    --bogus\n```", "has no flag --bogus"),
    ("```\ntorchrun --nproc-per-node 2 -m tierlm serve M --tp 2 --no-such\n```", "has no flag --no-such"),
    ("```\npython -m tierlm plan x --hardware this && tierlm bench io --cpu-mem 1GiB --nope\n```", "has no flag --nope"),
    ("`tierlm bench disk --nvme /x`", "not one of compute, io, train"),
    ("`tierlm fine-tune m`", "no such verb"),
    ("```\ntierlm bench train m --data d --finetune-args \"--seq-len 8 --sequence 3\"\n```",
     "has no flag --sequence (inside --finetune-args)"),
])
def test_a_made_up_verb_or_flag_is_caught(parser, doc, expected):
    n, problems = problems_in(doc, "doc.md", parser)
    assert n >= 1 and any(expected in p for p in problems), problems


@pytest.mark.parametrize("doc", [
    "```bash\ntierlm finetune MODEL --data train.jsonl --cpu-mem 4GiB ...   # a comment --not-a-flag\n```",
    "```\ntierlm plan M --hardware this | head -3\n```",
    "    tierlm generate: qwen3, weights bf16: 2/2 layers resident",
    "`tierlm generate: falcon, ...` is what it prints; `tierlm VERB --help` lists a verb's flags.",
    "```\nFOO=1 flock /tmp/x tierlm bench io --nvme /mnt --size 1GiB\n```",
])
def test_real_commands_comments_and_output_pass(parser, doc):
    assert problems_in(doc, "doc.md", parser)[1] == []
