"""Core AI assets through Apple's packages: converting torch modules into one `.aimodel` (coreai-torch), reading its
build record, and running its functions (coreai-core's runtime).

- Convert: each function's module is exported (`torch.export`, coreai-torch's decompositions), its compressed
  constants typed (`inject_subbyte_tensors`: 4-bit tables' indices become uint4), added to one `TorchConverter` as
  an entrypoint, and the program saved as an asset; the build record goes in the asset's own metadata
  (`creator_defined_metadata`, key `npumoe.build`).
- Run: where Core AI's OS framework takes specialization options (`SpecializationOptions.is_supported()`: macOS 27
  with the wheel's default backing) it loads the asset specialized for the Neural Engine
  (`SpecializationOptions.from_preferred_compute_unit_kind(ComputeUnitKind.neural_engine())`), once per process
  (whether it keeps the specialized form between processes is for a Mac to show). Elsewhere (Linux, macOS 26)
  Apple's in-package runtime runs it on the CPU: it needs the program lowered to an `.aimodelx` first (what
  `AIModelAsset.executable()` does in a temporary folder each time); that is done once per asset digest into the
  cache (`$NPUMOE_CACHE/coreai`), so a process loads it compiled; in a child process, out of the reach of the
  signal handlers LLVM installs while lowering (`_LOWER`). Apple's parser aborts the process on a corrupt
  program, so the asset's `main.mlirb` is checked against the sha256 it stores (`main.hash`) before either runs.
- Calls are coroutines: one event loop on a thread of its own serves every call, from any thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from runtime.errors import NpumoeError
from runtime.fileio import cache_root
from runtime.macos import on_macos

log = logging.getLogger("npumoe")

META_KEY = "npumoe.build"
OUTPUT_NAME = "y"
ASSET_SUFFIX = ".aimodel"
PROGRAM, PROGRAM_HASH = "main.mlirb", "main.hash"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """coreai-torch's import warnings (its torch validation stamp, torch.export's deprecations) and its progress line
    stay out of our output: said where it matters, in the backend's availability."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def coreai_import_error() -> str | None:
    """Why Core AI's packages cannot be used here, or None."""
    try:
        with quiet():
            import coreai.runtime  # noqa: F401
            import coreai_torch  # noqa: F401
    except ImportError as e:
        return f"Core AI's packages are not installed ({e.name}): pip install 'npumoe[coreai]'"
    return None


def on_neural_engine() -> bool:
    """Whether Core AI runs here on the Neural Engine: its OS framework taking SpecializationOptions, as coreai-core
    itself says (`SpecializationOptions.is_supported()`: a local build, `USE_LOCAL_COREAI` or an SDK-skewed macOS
    version make the version alone wrong)."""
    if not on_macos():
        return False
    try:
        from coreai.runtime import SpecializationOptions
    except ImportError:
        return False
    return bool(SpecializationOptions.is_supported())


def where_it_runs() -> str:
    """What runs an asset's functions here, said once by the backend."""
    if on_neural_engine():
        return "Core AI (macOS framework) on the Neural Engine"
    return "Apple's in-package Core AI runtime on the CPU (no Neural Engine here: its times say nothing about one)"


Function = tuple[str, torch.nn.Module, tuple[torch.Tensor, ...], Sequence[str]]  # name, module, inputs, input names


def to_program(functions: Iterable[Function], debug: bool = False):
    """`(name, module, example inputs, input names)` functions as one Core AI program (`AIProgram`), each exported
    with coreai-torch's decompositions as it comes (an iterator's module can go before the next is made: one
    function's torch copy of its weights at a time); `debug`: with torch stack traces."""
    with quiet():
        import coreai_torch
        from coreai_torch._compression.utils import inject_subbyte_tensors

        mode = coreai_torch.TorchConverter.Mode
        converter = coreai_torch.TorchConverter(mode=mode.DEBUG if debug else mode.RELEASE)
        for name, module, args, input_names in functions:
            with torch.no_grad():
                ep = torch.export.export(module.eval(), args).run_decompositions(coreai_torch.get_decomp_table())
            converter.add_exported_program(inject_subbyte_tensors(ep), entrypoint_name=name,
                                           input_names=list(input_names), output_names=[OUTPUT_NAME])
        return converter.to_coreai()


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A path beside `out` (in a hidden folder of its own) to write the asset at; removed when the block ends
    whatever happened (an error, SIGTERM), so `out` exists only once `commit` put a finished asset there."""
    folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".building", dir=out.parent))
    try:
        yield folder / out.name
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def save(program, path: Path, record: dict) -> None:
    """The program saved as an asset at `path`, `record` stored as its build metadata."""
    with quiet():
        asset = program.save_asset(path)
        asset.update_metadata(lambda m: m.set_custom(META_KEY, json.dumps(record)))


def commit(staging: Path, out: Path) -> None:
    """The finished asset moved from its staging path to `out` (an earlier one replaced)."""
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(staging, out)


def convert(functions: Sequence[Function], out: Path, record: dict) -> None:
    """Convert functions (`to_program`) into one asset at `out` (written whole beside it, then renamed), `record`
    stored as its build metadata."""
    program = to_program(functions)
    with staged(out) as path:
        save(program, path, record)
        commit(path, out)


def read_record(path: str | os.PathLike) -> dict:
    """The build record of an asset `autotune build --format coreai` wrote; refused in one line otherwise."""
    meta = Path(path) / "metadata.json"
    try:
        custom = json.loads(meta.read_text()).get("creatorDefinedMetadata") or {}
    except (OSError, ValueError) as e:
        raise NpumoeError(f"{path} is not a Core AI asset ({meta}: {e})") from None
    raw = custom.get(META_KEY) if isinstance(custom, dict) else None
    if raw is None:
        raise NpumoeError(f"{path} was not built by `autotune build --format coreai` (no {META_KEY} metadata)")
    return json.loads(raw) if isinstance(raw, str) else raw


def asset_digest(path: str | os.PathLike) -> str:
    """The asset's program digest (the `main.hash` it stores), hex: what its compiled form is cached by."""
    return (Path(path) / PROGRAM_HASH).read_bytes().hex()


_VERIFIED: dict[tuple, str] = {}  # (path, size, mtime) of a program already checked in this process -> digest


def verified_digest(path: str | os.PathLike) -> str:
    """The asset's digest, once its program is checked against it (sha256 of `main.mlirb` = `main.hash`): Apple's
    parser aborts the whole process on a corrupt program, and the lowered cache is keyed by the stored digest, so a
    corrupt copy of an asset lowered before would run the good one. Refused in one line naming the file."""
    program, stored = Path(path) / PROGRAM, Path(path) / PROGRAM_HASH
    try:
        st = program.stat()
        digest = stored.read_bytes().hex()
    except OSError as e:
        raise NpumoeError(f"{path} is not a whole Core AI asset ({e.strerror}: {e.filename}); rebuild it with "
                          "`autotune build --format coreai`") from None
    key = (str(program.resolve()), st.st_size, st.st_mtime_ns)
    if _VERIFIED.get(key) != digest:
        h = hashlib.sha256()
        with program.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        if h.hexdigest() != digest:
            raise NpumoeError(f"{program} is corrupt: its sha256 is not the {PROGRAM_HASH} the asset stores; rebuild "
                              "it with `autotune build --format coreai`")
        _VERIFIED[key] = digest
    return digest


class _Loop:
    """One asyncio loop on a daemon thread: Core AI's calls are coroutines, the executor's are plain calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="npumoe-coreai", daemon=True).start()

    def run(self, coro) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            # An interrupt (SIGTERM, Ctrl-C) raised in the waiting caller: the native call in flight ends first, or
            # the process would exit under it and Apple's runtime abort it (SIGABRT instead of our exit code).
            with contextlib.suppress(BaseException):
                concurrent.futures.wait([future])
            raise


_LOOP: _Loop | None = None
_LOOP_LOCK = threading.Lock()


def run_sync(coro) -> Any:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = _Loop()
    return _LOOP.run(coro)


# The lowering in a child process of its own: LLVM installs its signal handlers inside it (once per process), which on
# SIGTERM or SIGINT delete the file being written and re-raise to Python's, and the lowering then aborts the process
# on the missing file (SIGABRT instead of our exit 143, the staging folder left behind).
_LOWER = ("import sys; from pathlib import Path; from coreai.authoring import AIModelAsset; "
          "AIModelAsset.load(sys.argv[1])._write_odix(Path(sys.argv[2]))")


def _lower_apart(path: str | os.PathLike, staging: Path) -> None:
    """Lower the asset into `staging` in a child process out of the terminal's signals (its own session): an
    interrupt raised here kills it, and the caller removes what it left."""
    done = subprocess.run([sys.executable, "-c", _LOWER, str(path), str(staging)], capture_output=True, text=True,
                          start_new_session=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise NpumoeError(f"Core AI could not lower {path} for its in-package runtime: {tail}")


def compiled_path(path: str | os.PathLike, cache_dir: Path | None = None) -> Path:
    """The asset lowered for the in-package runtime (`.aimodelx`), made once per program digest."""
    dest = (cache_dir or cache_root() / "coreai") / f"{verified_digest(path)}.aimodelx"
    if (dest / "main-universal.odix").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".lower-", suffix=".aimodelx", dir=dest.parent))
    try:
        _lower_apart(path, staging)
        try:
            os.replace(staging, dest)
        except OSError:
            if not (dest / "main-universal.odix").is_file():  # else a concurrent process lowered it first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def neural_engine_options():
    """Core AI's specialization asking for the Neural Engine (macOS 27's framework only)."""
    from coreai.runtime import ComputeUnitKind, SpecializationOptions

    return SpecializationOptions.from_preferred_compute_unit_kind(ComputeUnitKind.neural_engine())


def load_model(path: str | os.PathLike):
    """The asset as a loaded `AIModel`: specialized for the Neural Engine on macOS 27, else on Apple's in-package
    runtime from its cached lowering."""
    from coreai.runtime import AIModel

    if on_neural_engine():
        verified_digest(path)
        return run_sync(AIModel.load(Path(path), specialization_options=neural_engine_options()))
    return run_sync(AIModel.load(compiled_path(path)))


def call(function, feed: dict[str, np.ndarray]) -> np.ndarray:
    """One call of a loaded function: numpy inputs by name -> its output."""
    from coreai.runtime import NDArray

    out = run_sync(function({k: NDArray(np.ascontiguousarray(v)) for k, v in feed.items()}))
    return out[OUTPUT_NAME].numpy()
