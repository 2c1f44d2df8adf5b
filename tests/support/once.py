"""What a pytest run computes once for all its xdist workers.

`--maxschedchunk 1` hands tests out one at a time, longest first, so two tests of one module
often land on different workers, and a module-scoped fixture is then computed on each. An
expensive one (a whole-trace simulation, collected static files) is computed by the first
worker to take its lock, stored in the run's shared temp folder, and read by the others.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def run_folder(tmp_path_factory) -> Path:
    """The folder one pytest run's workers share: the parent of each worker's base temp
    folder (without xdist that parent spans runs, so the base temp folder itself)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


class file_lock:
    """An exclusive lock on the file at `path` (created if need be), held by one process at a
    time."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> None:
        self._file = self.path.open("w")
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        self._file.close()  # closing releases the lock


class run_lock(file_lock):
    """An exclusive lock named `name`, held by one worker of the run at a time."""

    def __init__(self, tmp_path_factory, name: str):
        super().__init__(run_folder(tmp_path_factory) / f"{name}.lock")


def once_per_run(tmp_path_factory, name: str, compute: Callable[[], T]) -> T:
    """`compute()`'s value, computed by one worker of the run and unpickled by the others."""
    stored = run_folder(tmp_path_factory) / f"{name}.pickle"
    with run_lock(tmp_path_factory, name):
        if stored.exists():
            with stored.open("rb") as file:
                value: T = pickle.load(file)
            return value
        value = compute()
        partial = stored.with_suffix(".partial")
        with partial.open("wb") as file:
            pickle.dump(value, file, protocol=pickle.HIGHEST_PROTOCOL)
        partial.rename(stored)
        return value
