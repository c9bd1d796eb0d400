"""Every command in README.md and docs/*.md runs as printed after `make setup`.

The commands are the lines of the ```bash blocks (backslash continuations joined, `&&` / `;` / `|`
splitting one line into several commands). Checked cheaply and exactly, without running them:

- the program exists: `make` targets of the Makefile, `tools/*.py`, `pretrain_gpt.py`, `examples/*.sh`,
  `python -m` modules; nothing else is a command a reader can run here;
- every `--flag` a Python program is given is one its `--help` lists (each program's help read once), and a
  value given to a flag with choices is one of them;
- `python`, `torchrun` and `pip` run the venv's: either spelled `.venv/bin/...`, or after the document has
  shown the activation step `. .venv/bin/activate`;
- `pip install` names the checkout (`.[te]`), never the unpublished `megatron-delta[...]` package, and only
  extras the package declares;
- no placeholders (`...`, `[--flag V]`, `<x>`, `CKPT`, `path/to`): what a command reads (`--load`, `--hf`,
  `--metrics-file`, ...) exists in the checkout or is written by an earlier command of the README or of the
  same document. A block that is by nature a cluster template (torchrun on 8 GPUs, SLURM) says "template"
  in the text right above it; its flags are still checked, its paths are not.
"""
import functools
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from tests.helpers import REPO_ROOT as ROOT

DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md"))
ACTIVATE = ". .venv/bin/activate"
VENV_PROGRAMS = {"python": "python", ".venv/bin/python": "python", "torchrun": "torchrun",
                 ".venv/bin/torchrun": "torchrun", "pip": "pip", ".venv/bin/pip": "pip"}
# flags whose value a command reads: it must exist or be written by an earlier command
INPUT_FLAGS = {"--load", "--hf", "--metrics-file", "--tokens-file", "--render", "--input", "--tokenizer-model",
               "--data-path", "--train-data-path", "--valid-data-path"}
# flags whose value a command writes (a file, a directory or, for --output-prefix, a prefix)
OUTPUT_FLAGS = {"--save", "--output", "--out", "--run-dir", "--delta-metrics-file", "--output-prefix",
                "--model-prefix"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.[a-z]+)?/?$|\.\.\.|path/to|[<>\[\]]")


class Command:
    def __init__(self, doc, line, text, template, argv):
        self.doc, self.line, self.text, self.template, self.argv = doc, line, text, template, argv

    def __repr__(self):
        return f"{self.doc}:{self.line}: {self.text}"


def _split(text):
    """shell words of one command line, split further at && || ; | (comments dropped)."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    parts, cur = [], []
    for tok in lex:
        if tok in ("&&", "||", ";", "|", "&"):
            parts.append(cur)
            cur = []
        else:
            cur.append(tok)
    parts.append(cur)
    return [p for p in parts if p]


def doc_commands(doc):
    """Command per shell command of every ```bash block of `doc`, in order."""
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        above, k = [], i - 1  # the paragraph right above the fence
        while k >= 0 and not lines[k].strip():
            k -= 1
        while k >= 0 and lines[k].strip():
            above.append(lines[k])
            k -= 1
        template = "template" in " ".join(above).lower()
        i += 1
        buf, start = "", None
        while lines[i].strip() != "```":
            line = lines[i]
            start = i + 1 if start is None else start
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
            else:
                text = (buf + line).strip()
                for argv in _split(text):
                    out.append(Command(doc, start, text, template, argv))
                buf, start = "", None
            i += 1
        i += 1
    return out


INLINE = re.compile(r"`((?:[A-Z_]+=\S+ )*(?:\.venv/bin/)?(?:python|bash) [^`]+)`")


def inline_commands(doc):
    """Command per inline code span of the prose (outside the fenced blocks) that runs python or bash."""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    prose = re.sub(r"^```.*?^```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S | re.M)
    out = []
    for m in INLINE.finditer(prose):
        span = re.sub(r"\s+", " ", m.group(1))
        for argv in _split(span):
            out.append(Command(doc, prose.count("\n", 0, m.start()) + 1, span, True, argv))
    return out


ALL = [c for d in DOCS for c in doc_commands(d)]
# inline commands are checked like a template's: program, flags and the venv, not paths
INLINE_ALL = [c for d in DOCS for c in inline_commands(d)]


def _env_stripped(argv):
    i = 0
    while i < len(argv) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[i]):
        i += 1
    return argv[:i], argv[i:]


def parse_help(text):
    """{flag: choices or None (a value of any kind) or False (a switch)} from argparse --help output."""
    flags = {}
    for line in text.split("\n"):
        s = line.strip()
        if not s.startswith("-"):
            continue
        invocation = re.split(r"\s{2,}", s)[0]
        for alt in invocation.split(", "):
            m = re.match(r"^(--?[A-Za-z0-9][\w-]*)(?: (\S.*))?$", alt)
            if not m:
                continue
            meta = m.group(2)
            if meta is None:
                flags[m.group(1)] = False
            elif re.fullmatch(r"\{[^}]*\}", meta):
                flags[m.group(1)] = set(meta[1:-1].split(","))
            else:
                flags[m.group(1)] = None
    return flags


@functools.cache
def program_flags(*program):
    """The flags of `program` (a script and maybe its subcommand, or ('torchrun',)) from one --help run."""
    cmd = [sys.executable, "-m", "torch.distributed.run"] if program == ("torchrun",) else [sys.executable, *program]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd + ["--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(program)} --help failed:\n{r.stderr[-2000:]}"
    flags = parse_help(r.stdout)
    assert "--help" in flags, f"{' '.join(program)} --help printed no options:\n{r.stdout[:500]}"
    return flags


def makefile_targets():
    text = open(os.path.join(ROOT, "Makefile")).read()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def declared_extras():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def check_flags(program, args):
    """Errors for flags of `args` (up to a lone --) that `program`'s help does not list."""
    flags, errors = program_flags(*program), []
    for i, a in enumerate(args):
        if a == "--":
            break
        if not a.startswith("--"):
            continue
        name = a.split("=", 1)[0]
        if name not in flags:
            errors.append(f"{' '.join(program)} has no flag {name}")
            continue
        choices = flags[name]
        value = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else None)
        if isinstance(choices, set) and value not in choices:
            errors.append(f"{' '.join(program)} {name} takes one of {sorted(choices)}, not {value!r}")
    return errors


def split_program(argv):
    """(kind, script program tuple or None, args) of one command's words after the environment."""
    head, rest = argv[0], argv[1:]
    kind = VENV_PROGRAMS.get(head, head)
    if kind == "python" and rest[:2] == ["-m", "pip"]:
        return "pip", None, rest[2:]
    if kind == "python" and rest[:1] == ["-c"]:
        return "code", None, rest
    if kind == "python" and rest[:1] == ["-m"]:
        return "module", (rest[1],), rest[2:]
    if kind == "torchrun":
        opts = program_flags("torchrun")
        i = 0
        while i < len(rest) and rest[i].startswith("-"):
            i += 1 if opts.get(rest[i].split("=", 1)[0]) is False or "=" in rest[i] else 2
        return kind, rest[:i], rest[i:]
    return kind, None, rest


def script_program(args):
    """(script, subcommand?) and its arguments: convert_checkpoint.py export, compare_runs.py table."""
    script, rest = args[0], args[1:]
    if rest and re.fullmatch(r"[a-z]+", rest[0]):
        return (script, rest[0]), rest[1:]
    return (script,), rest


def command_errors(c):
    """Everything wrong with one command (an empty list when it runs as printed)."""
    _, argv = _env_stripped(c.argv)
    kind, extra, args = split_program(argv)
    errors = []
    if kind in (".", "source"):
        return [] if args == [".venv/bin/activate"] else [f"activate with `{ACTIVATE}`"]
    if kind == "make":
        targets = [a for a in args if "=" not in a and not a.startswith("-")]
        return [f"no make target {t}" for t in targets if t not in makefile_targets()]
    if kind == "pip":
        if args[:1] != ["install"]:
            return ["pip: only `pip install` is documented"]
        for spec in args[1:]:
            if spec.startswith("-"):
                continue
            m = re.fullmatch(r"\.\[([\w,-]+)\]", spec)
            if not m:
                errors.append(f"pip install {spec}: install extras from the checkout, e.g. '.[te]'")
            else:
                errors += [f"no extra [{e}] in the package" for e in m.group(1).split(",")
                           if e not in declared_extras()]
        return errors
    if kind == "code":
        return []
    if kind == "module":
        name = extra[0]
        return [] if importlib.util.find_spec(name) is not None else [f"no module {name}"]
    if kind == "torchrun":
        errors += check_flags(("torchrun",), extra)
    if kind in ("python", "torchrun"):
        if not args or not os.path.isfile(os.path.join(ROOT, args[0])):
            return errors + [f"no script {args[:1]}"]
        program, rest = script_program(args)
        return errors + check_flags(program, rest)
    if kind in ("bash", "sbatch") or kind.startswith("examples/"):
        script = argv[0] if kind.startswith("examples/") else (args[0] if args else "")
        if not (script.startswith("examples/") and os.path.isfile(os.path.join(ROOT, script))):
            return [f"no script {script!r} under examples/"]
        if script == "examples/torchrun_multinode.sh":
            return check_flags(("pretrain_gpt.py",), argv[1:] if kind.startswith("examples/") else args[1:])
        return []
    return [f"unknown program {argv[0]!r}: use make, .venv/bin/python (or python after `{ACTIVATE}`), "
            f"torchrun, bash examples/*.sh"]


def written_paths(c):
    """Paths (or prefixes) that `c` writes."""
    env, argv = _env_stripped(c.argv)
    out = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in OUTPUT_FLAGS]
    if "--output-prefix" in argv:
        out.append(argv[argv.index("--output-prefix") + 1] + "_text_document")
    if "--model-prefix" in argv:
        out.append(argv[argv.index("--model-prefix") + 1] + ".model")
    if argv[1:2] == ["-c"]:
        out += re.findall(r'open\("([^"]+)", "w"\)', argv[2])
    if argv[:2] == ["make", "demo"]:
        out.append("runs/default-delta_block")
    if len(argv) > 1 and argv[1] == "pretrain_gpt.py" and "--save" not in argv:
        residual = argv[argv.index("--residual") + 1] if "--residual" in argv else "baseline"
        out.append(f"runs/default-{residual}")  # the embedded run's checkpoint
    if "examples/compare_residuals.sh" in argv:
        out.append(dict(a.split("=", 1) for a in env).get("OUT", "runs/compare"))
    return [p.rstrip("/") for p in out]


def read_paths(c):
    _, argv = _env_stripped(c.argv)
    kind, _, args = split_program(argv)
    paths = []
    for i, a in enumerate(args[:-1]):
        if a in INPUT_FLAGS:
            j = i + 1
            while j < len(args) and not args[j].startswith("-"):  # nargs="+" flags
                paths.append(args[j])
                j += 1
    if args[:2] == ["tools/compare_runs.py", "table"]:
        paths += [a for a in args[2:] if not a.startswith("-") and a not in paths
                  and args[args.index(a) - 1] not in OUTPUT_FLAGS]
    return [p.split("=", 1)[-1] for p in paths]


def test_docs_have_commands():
    docs = {c.doc for c in ALL}
    assert "README.md" in docs and len(ALL) >= 20, sorted(docs)
    assert any(c.argv == [".", ".venv/bin/activate"] for c in ALL if c.doc == "README.md")
    assert any(c.argv[:2] == ["python", "tools/benchmark.py"] for c in INLINE_ALL if c.doc == "docs/performance.md")


@pytest.mark.parametrize("c", ALL + INLINE_ALL, ids=[f"{c.doc}:{c.line}:{c.argv[0]}" for c in ALL + INLINE_ALL])
def test_command_runs_as_printed(c):
    errors = command_errors(c)
    _, argv = _env_stripped(c.argv)
    if not c.template:
        errors += [f"placeholder {w!r}: name a path an earlier command writes, or say 'template' above a cluster "
                   f"template" for w in argv[1:] if PLACEHOLDER.search(w) and not w.startswith(".[")
                   and argv[1:2] != ["-c"]]
    assert not errors, f"{c}\n  " + "\n  ".join(errors)


def test_venv_programs_come_after_activation():
    """A bare python / torchrun / pip is the system's: the document shows `. .venv/bin/activate` before it."""
    bad = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        activated_at = text.find(ACTIVATE)
        for c in (c for c in ALL + INLINE_ALL if c.doc == doc):
            head = _env_stripped(c.argv)[1][0]
            if head in ("python", "python3", "torchrun", "pip", "pip3"):
                line_at = len("\n".join(text.split("\n")[:c.line - 1]))
                if activated_at < 0 or activated_at > line_at:
                    bad.append(f"{c}: `{head}` before `{ACTIVATE}` in {doc}")
    assert not bad, "\n".join(bad)


def test_read_paths_exist_or_are_written_earlier():
    """What a command reads exists in the checkout or an earlier command (README's, then the doc's) writes it."""
    readme_writes = [p for c in ALL if c.doc == "README.md" for p in written_paths(c)]
    bad = []
    for doc in DOCS:
        written = list(readme_writes) if doc != "README.md" else []
        for c in (c for c in ALL if c.doc == doc):
            if not c.template:
                for p in read_paths(c):
                    if not (os.path.exists(os.path.join(ROOT, p))
                            or any(p == w or p.startswith(w + "/") for w in written)):
                        bad.append(f"{c}: reads {p!r}, which no earlier command writes")
            written += written_paths(c)
    assert not bad, "\n".join(bad)


def test_checker_catches_a_misspelled_flag():
    """The check above is not vacuous: one wrong letter in a documented flag is reported."""
    c = next(c for c in ALL if c.argv[:2] == ["python", "tools/perplexity.py"] and "--load" in c.argv)
    typo = Command(c.doc, c.line, c.text, c.template, [a.replace("--load", "--laod") for a in c.argv])
    assert command_errors(typo) == ["tools/perplexity.py has no flag --laod"]
    published = Command("README.md", 0, "", False, ["pip", "install", "megatron-delta[te]"])
    assert command_errors(published) == [
        "pip install megatron-delta[te]: install extras from the checkout, e.g. '.[te]'"]


def test_outputs_are_gitignored():
    """Everything the documented commands write (checkpoints, exports, reports, JSON, PNGs) is ignored by git."""
    paths = sorted({p for c in ALL if not c.template for p in written_paths(c) if not os.path.isabs(p)})
    assert "hf/delta_block" in paths and "runs/default-delta_block" in paths, paths
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    assert sorted(r.stdout.split()) == paths, f"not in .gitignore: {sorted(set(paths) - set(r.stdout.split()))}"


README_BUDGET = 200  # lines: the page someone reads to decide, in five minutes; the reference is docs/


def test_readme_fits_its_budget():
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    assert len(lines) <= README_BUDGET, f"README.md: {len(lines)} lines (at most {README_BUDGET}): move detail to docs/"
