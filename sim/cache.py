"""Simulated points on disk: a point simulated once is read back, by any later report, until the model changes.

A result is stored under a key that is the SHA-256 of

* the task function (module and name) and the task, with every ``"calibration"`` value (a preset name or a file
  path) replaced by the hash of that calibration's **contents** (:meth:`Calibration.to_json`): the same pool and
  step model under another path hits, an edited file misses;
* the **code version** (:func:`code_version`): the hash of every file a result depends on (:data:`CODE_PACKAGES`:
  the core's and the simulator's sources, ``metronome/*.py`` and ``sim/*.py``, and the shipped presets), of the
  modules beside the task function's own (the report's tasks call its other modules), and the versions of the
  libraries that compute a result (:data:`LIBRARIES`: numba compiles the hot loop, numpy draws the random
  streams), so a change to the model invalidates every entry without anyone bumping a number.

The seed is part of every task, so it is part of the key. The store is :mod:`diskcache` (SQLite): each entry is
written in one transaction, so a process killed mid-write leaves no half-written entry, and two reports running
at once share it safely. Only the parent process reads and writes it; workers only compute.

Where: ``$METRONOME_CACHE_DIR`` if set (tests point it at a temporary folder), else
``$XDG_CACHE_HOME/metronome``, else ``~/.cache/metronome``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

CACHE_ENV = "METRONOME_CACHE_DIR"
SIZE_LIMIT_BYTES = 2**30  # diskcache evicts the least recently stored entries past this


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "metronome"


# What a result depends on besides its task, as (package, pattern): the core, the simulator and the presets (a task
# names its calibration, which is keyed by content, but a default may read another preset). One list, read by
# code_files: a package left out here would serve results computed by code that has since changed.
CODE_PACKAGES = (("metronome", "*.py"), ("metronome.sim", "*.py"), ("metronome.presets", "*.json"))
# the libraries whose version can change a result computed by the same code
LIBRARIES = ("numba", "llvmlite", "numpy", "scipy", "simpy")


def _package_dir(package: str) -> Path:
    return Path(importlib.import_module(package).__file__).parent


def code_files(extra_module: str | None = None) -> list[tuple[str, Path]]:
    """Every file :func:`code_version` hashes, each with the name it is hashed under (its package and file name):
    :data:`CODE_PACKAGES`, and the modules of ``extra_module``'s package (its own among them), when given."""
    parts = [(package, _package_dir(package), pattern) for package, pattern in CODE_PACKAGES]
    mod = sys.modules.get(extra_module) if extra_module else None
    if mod is not None and getattr(mod, "__file__", None):
        own = Path(mod.__file__)
        parts.append((mod.__package__, own.parent, "*.py") if mod.__package__ else (extra_module, own.parent, own.name))
    out: dict[str, Path] = {}
    for package, folder, pattern in parts:
        for p in sorted(folder.glob(pattern)):
            out.setdefault(f"{package}/{p.name}", p)
    return sorted(out.items())


def library_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


@functools.lru_cache(maxsize=None)
def code_version(extra_module: str | None = None) -> str:
    """The hash of :func:`code_files` (names and contents) and :func:`library_versions`."""
    h = hashlib.sha256()
    for name, p in code_files(extra_module):
        h.update(name.encode() + b"\0")
        h.update(p.read_bytes())
    h.update(json.dumps(library_versions(), sort_keys=True).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def calibration_digest(spec: str) -> str:
    """The hash of a calibration's contents (a preset name or a JSON path; loaded as the tasks load it)."""
    from metronome import calibration as calmod

    return hashlib.sha256(calmod.load(spec).to_json().encode()).hexdigest()


def _canonical(x: Any) -> Any:
    """A task as plain JSON: calibrations by content, dataclasses (a KVPolicy) by their fields."""
    if isinstance(x, dict):
        return {str(k): ("calibration:" + calibration_digest(v) if k == "calibration" and isinstance(v, str)
                         else _canonical(v)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_canonical(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__type__": type(x).__name__, **_canonical(dataclasses.asdict(x))}
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    raise TypeError(f"cannot key a cached task on a {type(x).__name__}")


def task_key(fn: Callable, task: Any) -> str:
    name = f"{fn.__module__}.{fn.__qualname__}"
    body = {"fn": name, "code": code_version(fn.__module__), "task": _canonical(task)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=True).encode()).hexdigest()


class ResultCache:
    """Task results by :func:`task_key`. ``enabled=False`` (``--no-cache``) runs everything and touches no disk."""

    def __init__(self, directory: str | Path | None = None, enabled: bool = True):
        self.enabled = enabled
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.hits = self.misses = self.writes = 0
        self._store = None

    def _open(self):
        """The store, or None when it cannot be opened (a read-only home, a file where the folder should be): the
        cache is a convenience, so the work runs without it, said once on stderr, rather than failing."""
        if self._store is None and self.enabled:
            import diskcache

            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._store = diskcache.Cache(str(self.directory), size_limit=SIZE_LIMIT_BYTES)
            except (OSError, diskcache.core.Timeout) as exc:
                print(f"metronome: cache of simulated points off ({self.directory}: {exc.strerror or exc})",
                      file=sys.stderr)
                self.enabled = False
        return self._store

    def map(self, executor, fn: Callable[[Any], Any], tasks: Sequence[Any],
            progress: Callable[[int], None] | None = None) -> list:
        """``executor.map(fn, tasks)``, reading what is stored and running (then storing) only the rest."""
        tasks = list(tasks)
        store = self._open()
        if store is None:
            self.misses += len(tasks)
            return executor.map(fn, tasks, progress=progress)
        keys = [task_key(fn, t) for t in tasks]
        out: list[Any] = [None] * len(tasks)
        todo = []
        for k, key in enumerate(keys):
            hit = store.get(key, default=_MISSING)
            if hit is _MISSING:
                todo.append(k)
            else:
                out[k] = hit
        self.hits += len(tasks) - len(todo)
        self.misses += len(todo)
        if progress and len(tasks) > len(todo):
            progress(len(tasks) - len(todo))
        if todo:
            for k, res in zip(todo, executor.map(fn, [tasks[k] for k in todo], progress=progress)):
                out[k] = res
                store.set(keys[k], res)
                self.writes += 1
        return out

    def wrap(self, executor) -> "CachedExecutor":
        return CachedExecutor(executor, self)

    def stats(self) -> dict:
        return {"enabled": self.enabled, "directory": str(self.directory) if self.enabled else None,
                "hits": self.hits, "misses": self.misses, "writes": self.writes}

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


class CachedExecutor:
    """An executor whose ``map`` goes through a :class:`ResultCache` (for code that takes an executor, e.g.
    :func:`metronome.sim.tuning.tune_aimd`)."""

    def __init__(self, inner, cache: ResultCache):
        self.inner, self.cache = inner, cache
        self.name = getattr(inner, "name", type(inner).__name__)

    def map(self, fn, items, progress=None) -> list:
        return self.cache.map(self.inner, fn, items, progress=progress)


_MISSING = object()
