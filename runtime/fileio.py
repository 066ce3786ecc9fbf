"""Atomic writes and versioned JSON reading shared by every stage's file format."""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runtime.errors import FileFormatError, NpumoeError
from runtime.interrupts import held


def cache_root() -> Path:
    """Where npumoe keeps what it can rebuild (host profiles, converted functions): $NPUMOE_CACHE, else
    ~/.cache/npumoe."""
    return Path(os.environ.get("NPUMOE_CACHE") or Path.home() / ".cache" / "npumoe")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename over `path`: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the mode a plain open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno and not e.filename:  # a full disk mid-write: say which file
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


DIGEST_SLOT = "0" * 64  # where a self-digesting file's own sha256 goes (hex), before it is known


def seal(data: bytes) -> bytes:
    """`data`, whose first DIGEST_SLOT marks where its digest belongs (in its header, ahead of any payload), with
    that slot filled by the sha256 of `data` as it is (slot still zeros): one digest over every byte, header
    included, so a reader detects any changed byte (`sealed_ok`)."""
    at = data.find(DIGEST_SLOT.encode())
    if at < 0:
        raise ValueError("no digest slot to seal")
    return data[:at] + hashlib.sha256(data).hexdigest().encode() + data[at + len(DIGEST_SLOT):]


def sealed_ok(data: bytes, digest: str) -> bool:
    """Whether `data` is what `seal` made with `digest` in its slot: the slot set back to zeros hashes to it."""
    mark = digest.encode()
    at = data.find(mark)
    if len(mark) != len(DIGEST_SLOT) or at < 0:
        return False
    return hashlib.sha256(data[:at] + DIGEST_SLOT.encode() + data[at + len(mark):]).hexdigest() == digest


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def output_set(*paths: str | os.PathLike) -> Iterator[list[Path]]:
    """Write a command's outputs as one set: yields a temp path beside each target (same suffix, for writers that
    go by it); when the block succeeds all are renamed into place, when it fails or is interrupted (SIGTERM,
    Ctrl-C: runtime.interrupts) none is, and the temps (and any folder made for them) are removed. A target that
    is a folder is refused before the block runs; a rename that fails midway puts back the files the set had
    replaced, so the set lands whole or not at all (NpumoeError naming the file)."""
    targets = [Path(p) for p in paths]
    for t in targets:
        if t.is_dir():
            raise NpumoeError(f"cannot write {t}: it is a directory; remove it or choose another output name")
    made = [d for t in targets for d in (t.parent, *t.parent.parents) if not d.exists()]
    for t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    temps = [t.with_name(f".{t.name}.{tag}.tmp{t.suffix}") for t in targets]
    done = False
    try:
        yield temps
        with held():  # a signal during the renames waits for the set to be whole (or put back)
            _commit(temps, targets, tag)
            done = True
    finally:
        with held():  # nor does one cut the removal of the temps short
            for tmp in temps:
                _remove(tmp)
            if not done:
                for d in sorted(set(made), key=lambda d: len(d.parts), reverse=True):
                    try:
                        d.rmdir()
                    except OSError:
                        pass


def _commit(temps: list[Path], targets: list[Path], tag: str) -> None:
    """Rename every temp over its target, or none: earlier files are moved aside first and put back on failure."""
    backups = [t.with_name(f".{t.name}.{tag}.old") for t in targets]
    moved: list[int] = []
    placed: list[int] = []
    try:
        for i, t in enumerate(targets):
            if t.exists() or t.is_symlink():
                os.replace(t, backups[i])
                moved.append(i)
        for i, (tmp, t) in enumerate(zip(temps, targets)):
            os.replace(tmp, t)
            placed.append(i)
    except BaseException as e:
        for i in placed:
            _remove(targets[i])
        for i in moved:
            os.replace(backups[i], targets[i])
        if not isinstance(e, OSError):
            raise
        raise NpumoeError(f"cannot write {e.filename2 or e.filename or targets[len(placed)]}: "
                          f"{e.strerror or e}; none of {', '.join(str(t) for t in targets)} was written") from None
    for i in moved:
        _remove(backups[i])


def read_versioned_json(path: str | os.PathLike, kind: str, version: int) -> dict:
    """Read a JSON file whose `schema` must be `npumoe.<kind>/<n>` with n <= version."""
    p = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise FileFormatError(kind, p, "file", f"cannot read: {e.strerror or e}") from None
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FileFormatError(kind, p, "file", f"not valid JSON ({e.__class__.__name__}: {str(e)[:80]})") from None
    check_schema(obj, kind, version, p)
    return obj


def check_schema(obj: Any, kind: str, version: int, path: str = "") -> None:
    if not isinstance(obj, dict):
        raise FileFormatError(kind, path, "file", "top level must be a JSON object")
    schema = obj.get("schema")
    prefix = f"npumoe.{kind}/"
    if not isinstance(schema, str) or not schema.startswith(prefix):
        raise FileFormatError(kind, path, "schema", f"expected '{prefix}{version}', got {schema!r}")
    try:
        n = int(schema[len(prefix):])
    except ValueError:
        raise FileFormatError(kind, path, "schema", f"bad version in {schema!r}") from None
    if n > version:
        raise FileFormatError(kind, path, "schema",
                              f"{schema} is newer than this npumoe reads ({prefix}{version}); upgrade npumoe")
    if n < 1:
        raise FileFormatError(kind, path, "schema", f"bad version in {schema!r}")


def _field_path(loc: tuple, root: str) -> str:
    """`layers[0].groups[1]`; a key with blanks or control characters (an unknown key, say) is quoted, so the
    error stays on one line."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).isprintable() or not str(part) or any(c.isspace() for c in str(part)):
            out += f"[{str(part)!r}]"
        else:
            out += f".{part}" if out else str(part)
    return out or root


def validation_error(kind: str, path: str, error: Any, within: tuple = ()) -> FileFormatError:
    """The first pydantic error as one FileFormatError that names the field and shows the bad value (`within`:
    where the validated object sits in the file)."""
    err = error.errors()[0]
    got = repr(err.get("input"))[:60] if err["type"] != "missing" else ""
    msg = err["msg"] + (f" (got {got})" if got else "")
    return FileFormatError(kind, path, _field_path(within + tuple(err["loc"]), kind), msg)
