"""Module structure: no import cycle inside `autotune/` or `runtime/` (function-level imports included: a lazy
import that closes a cycle is still a cycle), `runtime/` never imports `autotune/`, no module imports another's
private names, no two modules share a file name."""
import ast
from collections import Counter
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("autotune", "runtime")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports, anywhere in the file (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules}
    return found - {name}


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_is_found():
    graph = _graph()
    assert "autotune.costing.costmodel" in graph["autotune.profiling.profile"]
    assert "runtime.plan" in graph["runtime.executor"]
    assert "runtime.dense" in graph["runtime.executor"]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(m for m in _graph() if m.startswith("runtime")))
def test_runtime_never_imports_autotune(module):
    assert not {m for m in _graph()[module] if m.split(".")[0] == "autotune"}


@pytest.mark.parametrize("module", sorted(m for m in _graph() if m.startswith("autotune.commands.")))
def test_commands_do_not_import_each_other(module):
    """A command is a thin parser over a library function; commands share only their option helpers."""
    shared = {"autotune.commands", "autotune.commands.common", "autotune.commands.argtypes"}
    assert {m for m in _graph()[module] if m.startswith("autotune.commands")} - shared == set()


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers.py (and fixtures in conftest.py), never in another test file."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("test_") or n == "conftest"]
    assert offenders == []


def private_imports(path: Path) -> list[str]:
    """`module: name` for each private name (`_x`, dunders aside) that `path` imports from a project module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in PACKAGES):
            found += [f"{node.module}: {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_names():
    """A leading underscore says "this module's own": what another module needs is public, under a name that says
    what it is (tests and scripts included)."""
    files = [p for d in (*PACKAGES, "scripts", "tests") for p in (ROOT / d).rglob("*.py")]
    offenders = [f"{p.relative_to(ROOT)} imports {hit}" for p in sorted(files) for hit in private_imports(p)]
    assert offenders == []


def test_private_imports_are_found(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from runtime.plan import Plan, _x\nfrom . import _y\nfrom os import _exit\n"
                      "from runtime import __version__\n")
    assert private_imports(source) == ["runtime.plan: _x", "None: _y"]


def test_no_two_modules_share_a_file_name():
    """A folder per role: a file name says what a module holds, wherever it sits (package markers aside)."""
    names = Counter(p.name for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                    if p.name not in ("__init__.py", "__main__.py"))
    assert [n for n, c in names.items() if c > 1] == []


def test_pyproject_lists_every_package():
    """The wheel ships every package folder (the list is explicit because profiles/ maps into autotune.profiles)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert listed == found | {"autotune.profiles"}
