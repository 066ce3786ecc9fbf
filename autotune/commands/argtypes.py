"""Argparse value types: every option is checked where it is parsed, so bad input fails in one line before work.

Each type takes the option's string and returns the parsed value or raises `argparse.ArgumentTypeError`, whose
message argparse prints as `autotune <cmd>: error: argument --x: <message>` and exits 2 (see `OneLineParser`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from runtime.errors import NpumoeError

SQLITE_MAGIC = b"SQLite format 3\x00"


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (`autotune <cmd>: error: ...`, exit 2), without the
    usage block: scripts and people read the one line; `--help` still shows the usage.

    A value that starts with a minus and a digit (`--shapes -64x64`, `--seed -1`) is taken as the option's value,
    so the value type can say what is wrong with it, not "expected one argument": no option here looks like a
    negative number."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d")  # argparse's own test for "a value, not an option"

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _fail(message: str) -> NoReturn:
    raise argparse.ArgumentTypeError(message)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        _fail(f"expected an integer, got {text!r}")


def _float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        _fail(f"expected a number, got {text!r}")
    if not math.isfinite(x):
        _fail(f"must be a finite number, got {text!r}")
    return x


def _bounded(parse: Callable[[str], float], ok: Callable[[float], bool], requirement: str, name: str,
             doc: str) -> Callable[[str], float]:
    """A value type: `parse`, then refuse values outside `ok` with "must be <requirement>"."""
    def check(text: str):
        x = parse(text)
        if not ok(x):
            _fail(f"must be {requirement}, got {text!r}")
        return x

    check.__name__, check.__doc__ = name, doc
    return check


positive_int = _bounded(_int, lambda n: n >= 1, "a positive integer", "positive_int",
                        "An integer >= 1 (counts, token numbers, thread numbers).")
non_negative_int = _bounded(_int, lambda n: n >= 0, "a non-negative integer", "non_negative_int",
                            "An integer >= 0 (seeds).")
positive_float = _bounded(_float, lambda x: x > 0, "a positive number", "positive_float",
                          "A finite number > 0 (budgets in MB).")
non_negative_float = _bounded(_float, lambda x: x >= 0, "a non-negative number", "non_negative_float",
                              "A finite number >= 0 (a sampling temperature: 0 is greedy).")
port_number = _bounded(_int, lambda n: 0 <= n <= 65535, "in [0, 65535]", "port_number",
                       "A TCP port (0: any free one).")
unit_fraction = _bounded(_float, lambda x: 0.0 <= x <= 1.0, "in [0, 1]", "unit_fraction",
                         "A share in [0, 1] (an agreement rate).")
fraction_below_one = _bounded(_float, lambda x: 0.0 <= x < 1.0, "in [0, 1)", "fraction_below_one",
                              "A share in [0, 1) (a drop budget: 0 allowed, 1 would allow dropping everything).")


def input_file(text: str) -> str:
    """An existing, readable regular file."""
    p = Path(text)
    if not p.exists():
        _fail(f"no such file: {text}")
    if p.is_dir():
        _fail(f"{text} is a directory, not a file")
    if not os.access(p, os.R_OK):
        _fail(f"{text} is not readable")
    return text


PACKAGE_SUFFIXES = (".mlpackage", ".aimodel")  # what `autotune build` writes: Core ML packages, Core AI assets


def input_package(text: str) -> str:
    """An existing built package folder (X.mlpackage, X.aimodel) or a build's X.manifest.json."""
    p = Path(text)
    if not p.exists():
        _fail(f"no such package: {text}")
    if p.name.endswith(PACKAGE_SUFFIXES) and not p.is_dir():
        _fail(f"{text} is not a package folder")
    if not p.name.endswith((*PACKAGE_SUFFIXES, ".json")):
        _fail(f"{text} is neither a package folder ({', '.join(PACKAGE_SUFFIXES)}) nor a .json manifest")
    return text


def traces_file(text: str) -> str:
    """An existing traces file, or where `search` may calibrate missing traces into."""
    return input_file(text) if Path(text).exists() else check_output_file(text)


def _nearest_existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists():
        p = p.parent
    return p


def _check_writable_dir(d: Path, text: str) -> None:
    """`d` is an existing directory we can create files in: tried for real (root ignores permission bits, but
    not read-only mounts, and os.access says nothing about those)."""
    if not d.is_dir():
        _fail(f"{text}: {d} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".npumoe-write-check.", dir=d)
    except OSError as e:
        _fail(f"{text}: cannot write in {d} ({e.strerror or e})")
    os.close(fd)
    os.unlink(tmp)


def check_output_file(text: str, suffix: str | None = None) -> str:
    """A file we can write: not a directory, with `suffix` when given, its folder writable. A missing folder is
    fine when the nearest existing one is writable: the writer creates it (as for the default output paths)."""
    p = Path(text)
    if suffix and not p.name.endswith(suffix):
        _fail(f"{text} must end in {suffix}")
    if p.is_dir():
        _fail(f"{text} is a directory; give a file name")
    _check_writable_dir(_nearest_existing(p.parent), text)
    return text


def output_file(suffix: str | None = None) -> Callable[[str], str]:
    """The argparse type of an output file (see `check_output_file`)."""
    def check(text: str) -> str:
        return check_output_file(text, suffix)
    return check


# What matplotlib's savefig writes by file suffix (it appends .png to a name without one).
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def plot_file(text: str) -> str:
    """A figure to write: a file name ending in one of PLOT_SUFFIXES in a writable folder."""
    if not text.lower().endswith(PLOT_SUFFIXES):
        _fail(f"{text} must end in one of {', '.join(PLOT_SUFFIXES)}")
    return check_output_file(text)


def output_package(text: str) -> str:
    """A package to (over)write: ends in .mlpackage or .aimodel, is not a file, its folder writable."""
    p = Path(text)
    if not p.name.endswith(PACKAGE_SUFFIXES) or p.name in PACKAGE_SUFFIXES:
        _fail(f"{text} must end in {' or '.join(PACKAGE_SUFFIXES)}")
    if p.exists() and not p.is_dir():
        _fail(f"{text} exists and is not a package folder")
    _check_writable_dir(_nearest_existing(p.parent), text)
    return text


def require_output(path: str | os.PathLike, option: str, package: bool = False) -> None:
    """Check an output path after parsing (a default the parser never saw), before any work starts."""
    try:
        (output_package if package else check_output_file)(str(path))
    except argparse.ArgumentTypeError as e:
        raise NpumoeError(f"{option}: {e}") from None


def input_directory(text: str) -> str:
    """An existing directory to read from."""
    if not Path(text).is_dir():
        _fail(f"{text} is not an existing directory")
    return text


def directory(text: str) -> str:
    """A directory that exists or can be created: not a file, the nearest existing ancestor writable."""
    p = Path(text)
    if p.exists() and not p.is_dir():
        _fail(f"{text} is a file, not a directory")
    _check_writable_dir(_nearest_existing(p), text)
    return text


def _is_sqlite(f) -> bool:
    return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


def _is_journal(f) -> bool:
    try:
        first = json.loads(f.readline())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(first, dict) and "op_code" in first


def _check_store_file(text: str, path: str, example: str, looks_right: Callable, kind: str) -> None:
    """A storage file: its folder exists; an existing non-empty file must be `kind` (an empty one is new to both
    libraries); a new one must be creatable."""
    p = Path(path)
    if not path:
        _fail(f"{text}: no file name; use {example}")
    if not p.parent.is_dir():
        _fail(f"{text}: no such directory: {p.parent}")
    if p.is_dir():
        _fail(f"{text}: {path} is a directory")
    if p.exists() and p.stat().st_size > 0:
        with open(p, "rb") as f:
            if not looks_right(f):
                _fail(f"{text}: {path} is not {kind}")
    else:
        _check_writable_dir(p.parent, text)


def _check_database_driver(text: str) -> None:
    """Other SQLAlchemy URLs (postgresql://, mysql://...): the dialect and its driver must be installed. Nothing
    connects here; a server that is down still fails when the search opens the storage."""
    try:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError, NoSuchModuleError
    except ImportError:
        _fail(f"{text}: database storage needs sqlalchemy; use sqlite:///FILE or journal:FILE")
    try:
        url = make_url(text)
        url.get_dialect().import_dbapi()
    except (ArgumentError, NoSuchModuleError, ValueError):
        _fail(f"{text}: not a storage URL; use sqlite:///FILE, journal:FILE or a SQLAlchemy database URL")
    except ImportError as e:
        _fail(f"{text}: the database driver is not installed ({getattr(e, 'name', None) or e}); "
              "use sqlite:///FILE or journal:FILE")


def storage_url(text: str) -> str:
    """An Optuna storage: `sqlite:///FILE` (its folder exists; an existing file is an SQLite database),
    `journal:FILE` (its folder exists; an existing file is an Optuna journal) or a database URL whose driver is
    installed."""
    if text.startswith("sqlite:///"):
        _check_store_file(text, text[len("sqlite:///"):], "sqlite:///path/to/file.db", _is_sqlite, "an SQLite database")
    elif text.startswith("journal:"):
        _check_store_file(text, text[len("journal:"):], "journal:path/to/file.log", _is_journal,
                          "an Optuna journal file")
    elif "://" in text:
        _check_database_driver(text)
    else:
        _fail(f"{text!r} is not a storage URL; use sqlite:///FILE or journal:FILE")
    return text


def shape_list(text: str) -> str:
    """`--shapes`: named sizes or HIDDENxFFN with positive sizes (parsed again by profiling.settings.parse_shapes)."""
    from autotune.profiling.settings import parse_shapes

    try:
        shapes = parse_shapes(text)
    except NpumoeError as e:
        _fail(str(e).removeprefix("--shapes: "))
    if not shapes:
        _fail("must name at least one size")
    bad = [name for name, (h, f) in shapes.items() if h < 1 or f < 1]
    if bad:
        _fail(f"sizes must be positive, got {', '.join(bad)}")
    return text


def non_empty_list(text: str) -> list[str]:
    """A comma-separated list with at least one item."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        _fail("must name at least one item (comma-separated)")
    return items


def static_backend(text: str) -> str:
    """A backend a plan's group may name: a registered static backend (built-in or plugin)."""
    from runtime.backends import registry

    names = registry.plannable()
    if text not in names:
        _fail(f"unknown backend {text!r}; choose from {', '.join(names)}")
    return text


def exact_path(text: str) -> str:
    """An exact path a plan may name: a registered one (built-in or plugin)."""
    from runtime.backends import registry

    names = registry.exact_paths()
    if text not in names:
        _fail(f"unknown exact path {text!r}; choose from {', '.join(names)}")
    return text


def backend_list(text: str) -> list[str]:
    """A comma-separated list of registered backends (what `profile-device` measures)."""
    from runtime.backends import registry

    items, names = non_empty_list(text), list(registry.infos())
    for item in items:
        if item not in names:
            _fail(f"unknown backend {item!r}; choose from {', '.join(names)}")
    return items


def choice_list(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated list of some of `choices` (at least one, each once), e.g. `--compress none,int8`."""
    def check(text: str) -> tuple[str, ...]:
        items = non_empty_list(text)
        bad = [t for t in items if t not in choices]
        if bad:
            _fail(f"{bad[0]!r} is not one of {', '.join(choices)}")
        return tuple(dict.fromkeys(items))

    return check


def cpu_storage(text: str) -> str:
    """`--cpu-weights`: bf16, int8 or int4[:group] (`autotune.costing.cpu_storage.parse_storage`), as given."""
    from autotune.costing.cpu_storage import parse_storage

    try:
        parse_storage(text)
    except NpumoeError as e:
        _fail(str(e).split(": ", 1)[1])
    return text
