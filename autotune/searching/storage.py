"""Where a search's Optuna studies live and what they are named: the `--storage` URL, the one-search lock on SQLite
storage, and the study prefix that lets a study resume only for the same inputs."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from autotune.calibration.traces import Traces
from autotune.costing.costmodel import CostModel
from runtime.errors import NpumoeError
from runtime.plan import ModelSpec


def optuna_storage(url: str | None):
    """`--storage` as Optuna takes it: None (in memory), a database URL, or `journal:FILE` (JournalStorage)."""
    if url is None:
        return None
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url[len("journal:"):]))
    return url


def study_prefix(spec: ModelSpec, cost: CostModel, traces: Traces, resident_mb: float, objective: str,
                 prompt_tokens: int) -> str:
    """Studies resume only for the same model, cost model, traces, prompts, backend limits and objective: trials
    scored under another profile or other traces would mislead the sampler. (The space's digest and the chunk size
    are added per study by the search.)"""
    key = json.dumps([cost.to_json(), traces.header, resident_mb, prompt_tokens], sort_keys=True, default=str)
    return f"npumoe:{spec.fingerprint[7:19]}:{hashlib.sha256(key.encode()).hexdigest()[:12]}:{objective}"


@contextmanager
def one_search_per_sqlite(url: str | None) -> Iterator[None]:
    """SQLite storage serves one search at a time: two at once race on creating its tables and on the trials
    they enqueue. A second search on it is refused (pointing to journal:, which is made for several processes)
    by an exclusive lock on <file>.lock, held for the whole search and removed after it (still locked, so a
    search that opened the old file sees it gone and is refused rather than running beside a newer one)."""
    if not url or not url.startswith("sqlite:///"):
        yield
        return
    lock = Path(url[len("sqlite:///"):] + ".lock")
    busy = NpumoeError(f"--storage {url} is in use by another search; SQLite storage takes one search at a "
                       "time: run concurrent searches on --storage journal:FILE")
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        try:
            if os.stat(lock).st_ino != os.fstat(f.fileno()).st_ino:  # removed by the search that held it
                raise busy
        except FileNotFoundError:
            raise busy from None
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
