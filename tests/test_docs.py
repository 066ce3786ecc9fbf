"""The project's docs live in the repository: README, docs/ and code never point outside it, and every relative
link in README and docs/ resolves."""
import re
from pathlib import Path

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
