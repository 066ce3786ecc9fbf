"""The project's docs live in the repository: README, docs/ and code never point outside it, and every relative
link in README and docs/ resolves."""
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "autotune").rglob("*.py"),
           *(ROOT / "runtime").rglob("*.py"), *(ROOT / "scripts").glob("*"), *(ROOT / "tests").glob("*.py")]
OUTSIDE = "shared" + "/"  # spelled apart so this file does not match itself


def test_nothing_points_outside_the_repository():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES if p.is_file()
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if OUTSIDE in line]
    assert hits == []


def test_relative_links_in_readme_and_docs_resolve():
    docs = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    assert {p.name for p in docs} >= {"README.md", "architecture.md", "formats.md", "backends.md", "ane-facts.md"}
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://")) and not (doc.parent / target).exists():
                broken.append(f"{doc.name} -> {target}")
    assert broken == []


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Run the tests", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = [line for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [block] and "ruff check ." in block and "pytest" in block


def _modules() -> list[Path]:
    return sorted(p for pkg in ("autotune", "runtime") for p in (ROOT / pkg).rglob("*.py")
                  if p.stem not in ("__init__", "__main__"))


def test_the_architecture_page_names_every_module():
    layout = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in _modules() if not re.search(rf"`{p.stem}(\.py)?`", layout)]
    assert missing == []


def test_every_subpackage_says_what_it_holds():
    import ast

    for init in sorted(p for pkg in ("autotune", "runtime") for p in (ROOT / pkg).rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 8 and "see docs/architecture.md" not in doc, init


# --- the front page, the generated command reference, and every command and flag the docs name ---

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_WORDS, README_LINE_CHARS = 1500, 200
# Commands whose flags are not ours: a segment starting with one of these is not checked.
FOREIGN = ("pip ", "python3 -m venv", "python -m pytest", "pytest ", "curl ", "mlx_lm", "lm_eval ", "ruff ",
           "uvicorn ", "git ", "cd ", ". ", "export ")


def _make_docs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_docs", ROOT / "scripts" / "make_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _subparsers(parser) -> dict:
    import argparse

    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_command_reference_is_current():
    make_docs = _make_docs()
    page = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    assert page == make_docs.render(), f"docs/commands.md differs from the parsers: run `{make_docs.REGENERATE}`"


def test_command_reference_follows_a_flags_help():
    """Changing a flag's help changes the page: the page is the parsers', not a copy."""
    from autotune.cli import build_parser

    make_docs = _make_docs()
    parser = build_parser()
    trials = next(a for a in _subparsers(parser)["search"]._actions if "--trials" in a.option_strings)
    trials.help = "Optuna trials per MoE layer, said another way"
    page = make_docs.render(parser)
    assert "| `--trials N` | Optuna trials per MoE layer, said another way |" in page
    assert page != make_docs.render()


def _main_job_printed(summary: str) -> str:
    """What the main job prints around a plan summary: its gate's measured lines and the closing line."""
    lines = summary.splitlines()
    at = lines.index("why (predicted):")
    gate = ["fidelity gate (measured: 4096 tokens, 31.5 s; peak RSS 915 MiB):",
            "   # predicted ms  ppl delta   top-1   mean KL static groups              compressed         passed",
            "   0       0.8799    -0.053%  0.9915  2.19e-04 none (all CPU)             -             yes <- chosen"]
    return "\n".join(lines[:at] + gate + lines[at:] + ["wrote plans/p.json (+ p.report.json) in 3.0 s"]) + "\n"


def _another_figure(summary: str) -> str:
    """The summary with the tuned plan's latency one step of its last decimal higher."""
    line = next(x for x in summary.splitlines() if x.startswith("tuned plan "))
    figure = line.split()[2]
    changed = f"{float(figure) + 10 ** -len(figure.split('.')[1]):.{len(figure.split('.')[1])}f}"
    return summary.replace(line, line.replace(figure, changed, 1))


def test_the_docs_check_fails_when_the_main_job_prints_another_summary(tmp_path, monkeypatch):
    """`make_docs.py --check` holds the main job's printed plan summary (the gate's measured lines and the closing
    line left out) against the block in docs/measurements.md: the same passes, one changed figure fails, and
    `--figures` writes the summary printed into the block."""
    make_docs = _make_docs()
    page = (ROOT / "docs" / "measurements.md").read_text(encoding="utf-8")
    documented = make_docs.documented_summary(page)
    assert documented.startswith("design ") and "the plan leaves ane idle" in documented
    assert make_docs.check_figures(lambda: _main_job_printed(documented)) == []
    changed = _another_figure(documented)
    assert changed != documented
    problems = make_docs.check_figures(lambda: _main_job_printed(changed))
    assert len(problems) == 1 and "The main job on tiny-moe" in problems[0] and changed in problems[0]
    monkeypatch.setattr(make_docs, "MEASUREMENTS", tmp_path / "measurements.md")
    make_docs.MEASUREMENTS.write_text(page, encoding="utf-8")
    make_docs.write_figures(lambda: _main_job_printed(changed))
    written = make_docs.MEASUREMENTS.read_text(encoding="utf-8")
    assert make_docs.documented_summary(written) == changed and written.replace(changed, documented) == page


@pytest.mark.slow
def test_the_main_job_prints_the_documented_summary():
    """The main job on the pinned traces, run now in a fresh folder (about a minute), prints the summary
    docs/measurements.md holds: the plan's predicted figures given the same traces, on any CPU."""
    assert _make_docs().check_figures() == []


@pytest.mark.slow
def test_this_host_calibrates_the_pinned_traces_within_bf16_ties(tmp_path):
    """The pinned traces are what a calibration here records, up to bf16's near-ties: tiny-moe routes in bf16, and a
    token whose k-th and (k+1)-th router weights lie within bf16's error (2^-8 of the hidden state) goes either way
    with another CPU's kernels; a token routed apart in one layer carries another state into the next. Measured on an
    AMD EPYC: 96 of 32,768 token-layers routed apart between its AVX-512 and torch's portable kernels (2 with AVX2).
    Bound: 1%, five times that; a changed model, text or calibration routes most tokens apart."""
    import subprocess
    import sys

    from autotune.calibration.traces import load_traces, routing_agreement

    make_docs = _make_docs()
    out = tmp_path / "traces.npz"
    argv = [str(out) if a == make_docs.PINNED_TRACES else a for a in make_docs.PIN_TRACES]
    subprocess.run([sys.executable, "-m", "autotune", *argv], cwd=tmp_path, check=True, capture_output=True)
    pinned, now = load_traces(ROOT / make_docs.PINNED_TRACES), load_traces(out)
    assert now.header == pinned.header
    agreement = routing_agreement(now, pinned)
    assert agreement["tokens"] == 4 * 8192 and agreement["agree"] >= 0.99 * agreement["tokens"], agreement


def _prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside code blocks and tables."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("|"):
            lines.append(line)
    return lines


def test_readme_is_short():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.split()) <= README_WORDS  # as `wc -w` counts
    long = [line[:60] for line in _prose_lines(text) if len(line) > README_LINE_CHARS]
    assert long == []


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sections(page: Path) -> dict[str, str]:
    """Each heading's anchor -> the text under it, up to the next heading of any level."""
    out, anchor, fenced = {}, "", False
    for line in page.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        m = None if fenced else re.match(r"#+ (.*)", line)
        if m:
            anchor = _slug(m.group(1))
            n = sum(a == anchor or re.fullmatch(rf"{re.escape(anchor)}-\d+", a) is not None for a in out)
            anchor = f"{anchor}-{n}" if n else anchor
            out[anchor] = ""
        elif anchor:
            out[anchor] += line + "\n"
    return out


def test_every_anchor_in_readme_and_docs_exists():
    broken = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            page = (doc.parent / target) if target else doc
            if page.suffix == ".md" and page.exists() and anchor not in _sections(page):
                broken.append(f"{doc.name} -> {target}#{anchor}")
    assert broken == []


def _numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}


def test_every_figure_in_the_readme_table_links_to_its_command_host_and_date():
    """Each row of "What it achieves": its figure links to a section of docs/ that holds the same numbers, a
    command, a host and a date, and says the same kind (predicted or measured)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## What it achieves", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    assert len(rows) >= 6
    for row in rows:
        what, figure, kind = (c.strip() for c in row.strip("|").split(" | "))
        link = re.fullmatch(r"\[([^\]]+)\]\((docs/[\w.-]+\.md)#([\w-]+)\)", figure)
        assert link, f"the figure of {what!r} is not one link to a docs section"
        shown, page, anchor = link.groups()
        section = _sections(ROOT / page).get(anchor)
        assert section is not None, f"{what!r}: {page}#{anchor} does not exist"
        assert kind.split()[0] in ("predicted", "measured") and kind.split()[0] in section.lower(), what
        assert _numbers(shown) <= _numbers(section), f"{what!r}: {shown} not all in {page}#{anchor}"
        assert re.search(r"\d{4}-\d{2}-\d{2}", section), f"{page}#{anchor} gives no date"
        assert "host" in section.lower(), f"{page}#{anchor} names no host"
        assert re.search(r"`(autotune [a-z-]+|python scripts/\w+\.py)[ `]", section), f"{page}#{anchor}: no command"


def _code_texts(text: str) -> list[str]:
    """The shell-like pieces of a Markdown text: each command line of its shell code blocks (an indented line goes
    on the line before it) and each inline code span outside code blocks."""
    pieces, shell = [], False
    for i, part in enumerate(re.split(r"^```([^\n]*)\n(.*?)^```", text, flags=re.S | re.M)):
        if i % 3 == 1:
            shell = part in ("", "bash", "sh", "console")
        elif i % 3 == 2 and shell:
            for line in part.splitlines():
                if line[:1].isspace() and pieces:
                    pieces[-1] += " " + line.strip()
                else:
                    pieces.append(line)
        elif i % 3 == 0:
            pieces += re.findall(r"`([^`\n]+)`", part)
    return pieces


def _segments(piece: str) -> list[str]:
    """A piece cut at `&&`, `;` and comments, table pipes unescaped."""
    piece = piece.replace("\\|", "|").split(" # ", 1)[0]
    return [s.strip() for s in re.split(r"&&|;", piece) if s.strip()]


def _flags(text: str) -> list[str]:
    return re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text)


def _known_flags() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(each command -> its flags, the top level's under ""), (each script -> the flags it spells)."""
    from autotune.cli import build_parser

    parser = build_parser()
    commands = {name: {o for a in p._actions for o in a.option_strings} for name, p in _subparsers(parser).items()}
    commands[""] = {o for a in parser._actions for o in a.option_strings}
    scripts = {p.name: set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)", p.read_text(encoding="utf-8")))
               for p in (ROOT / "scripts").iterdir() if p.is_file()}
    return commands, scripts


def _unreal(name: str, text: str, commands: dict[str, set[str]], scripts: dict[str, set[str]]) -> list[str]:
    """The commands, scripts and flags `text` names that do not exist: `autotune X --flag` needs X to be a command
    with that flag, `scripts/Y.py --flag` a script spelling it, and a code span that starts with a flag a flag of
    some command or script."""
    every = set().union(*commands.values(), *scripts.values())
    wrong = []
    for piece in _code_texts(text):
        for seg in _segments(piece):
            if seg.startswith(FOREIGN):
                continue
            for m in re.finditer(r"(?:^|[\s(])(?:python -m )?autotune (<?[\w-]+)|(?:^|[\s(])(?:python )?scripts/"
                                 r"([\w.*-]+)", seg):
                rest = re.split(r"\bautotune |scripts/", seg[m.end():], maxsplit=1)[0]
                command, script = m.groups()
                if command and command.startswith("<"):  # a placeholder: `autotune <command> --help`
                    continue
                if command and command.startswith("-"):
                    rest, command = command + " " + rest, ""
                said = f"autotune {command}" if command is not None else f"scripts/{script}"
                matched = [n for n in scripts if fnmatch.fnmatch(n, script)] if script is not None else []
                if (command is not None and command not in commands) or (script is not None and not matched):
                    wrong.append(f"{name}: no such command or script: {said}")
                    continue
                known = commands[command] | commands[""] if command is not None else set().union(
                    *(scripts[n] for n in matched))
                wrong += [f"{name}: {said} has no {f}" for f in _flags(rest) if f not in known]
            if seg.startswith("--"):
                wrong += [f"{name}: no command or script has {f}" for f in _flags(seg)[:1] if f not in every]
    return wrong


def test_every_command_and_flag_the_docs_name_is_real():
    commands, scripts = _known_flags()
    wrong = [w for doc in DOCS for w in _unreal(doc.name, doc.read_text(encoding="utf-8"), commands, scripts)]
    assert wrong == [], wrong


def test_a_made_up_command_flag_or_script_is_caught():
    commands, scripts = _known_flags()
    text = ("Run `autotune search --model M --trials 5 --no-such-flag`, then `autotune frobnicate`,\n"
            "`python scripts/bench_prefill.py --shape qwen3-30b-a3b --no-such-option`, `--nowhere`, "
            "`scripts/no_such.py`.\n\n```bash\nautotune run --model M \\\n  --plan P --made-up\n```\n"
            "```python\nfrom autotune import search_plan  # not a command line\n```\n")
    assert _unreal("t", text, commands, scripts) == [
        "t: autotune search has no --no-such-flag", "t: no such command or script: autotune frobnicate",
        "t: scripts/bench_prefill.py has no --no-such-option", "t: no command or script has --nowhere",
        "t: no such command or script: scripts/no_such.py", "t: autotune run has no --made-up"]
