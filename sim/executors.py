"""Where fan-out work runs: a local process pool (default) or a Ray cluster (optional extra ``ray``).

Every task carries its own seed, so results do not depend on the executor, the worker or the order in
which tasks finish; both executors return results in the order of the inputs.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Callable, Sequence

from metronome.errors import MetronomeError

EXECUTORS = ("local", "ray")


class LocalExecutor:
    """A local process pool: a fresh one for each map (each sees the process as it is then), or one kept for every
    map inside :meth:`kept` (a report maps six phases in a row, and a fresh pool for each would pay every worker's
    start, its imports and numba's cached code, six times)."""

    name = "local"

    def __init__(self, workers: int | None = None):
        if workers is not None and workers < 1:
            raise MetronomeError(f"--workers must be >= 1, got {workers}")
        self.workers = workers or os.cpu_count() or 1
        self._pool: ProcessPoolExecutor | None = None

    @contextmanager
    def kept(self):
        """Run every map inside on one pool of workers, shut down on the way out."""
        if self._pool is not None or self.workers <= 1:
            yield self
            return
        self._pool = ProcessPoolExecutor(max_workers=self.workers)
        try:
            yield self
        finally:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], progress: Callable[[int], None] | None = None) -> list:
        if self.workers <= 1 or len(items) <= 1:
            out = []
            for x in items:
                out.append(fn(x))
                if progress:
                    progress(1)
            return out
        if self._pool is not None:
            return self._gather(self._pool, fn, items, progress)
        with ProcessPoolExecutor(max_workers=min(self.workers, len(items))) as pool:
            return self._gather(pool, fn, items, progress)

    @staticmethod
    def _gather(pool, fn, items, progress) -> list:
        results: list[Any] = [None] * len(items)
        futures = {pool.submit(fn, x): k for k, x in enumerate(items)}
        try:
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                if progress:
                    progress(1)
        except BaseException:  # a task failed or the user stopped: nothing more of this map runs
            for fut in futures:
                fut.cancel()
            raise
        return results


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail fast, before any work, when a ``host:port`` Ray address does not answer."""
    if address in ("auto", "local") or "://" in address and not address.startswith("ray://"):
        return
    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    host, _, port = hostport.rpartition(":")
    try:
        port_n = int(port)
    except ValueError:
        raise MetronomeError(f"--ray-address {address!r}: expected HOST:PORT, ray://HOST:PORT or auto") from None
    try:
        with socket.create_connection((host or "127.0.0.1", port_n), timeout=timeout_s):
            pass
    except OSError as exc:
        raise MetronomeError(f"Ray cluster at {address} is unreachable ({exc.strerror or exc}); no work was started") from None


class RayExecutor:
    """Runs each task as a Ray remote function. Without an address, starts a local Ray instance."""

    name = "ray"

    def __init__(self, address: str | None = None, workers: int | None = None):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise MetronomeError("--executor ray needs Ray: pip install 'metronome[ray]'") from None
        if address:
            _check_reachable(address)
        self.address, self.workers = address, workers

    def _init(self):
        import ray

        if not ray.is_initialized():
            kw: dict[str, Any] = dict(ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
            if self.address:
                kw["address"] = self.address
            else:
                kw["num_cpus"] = self.workers or os.cpu_count() or 1
            try:
                ray.init(**kw)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise MetronomeError(f"cannot start or join Ray ({str(exc).splitlines()[0]})") from None
        return ray

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], progress: Callable[[int], None] | None = None) -> list:
        ray = self._init()
        remote = ray.remote(fn)
        refs = [remote.remote(x) for x in items]
        index = {r: k for k, r in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for r in done:
                results[index[r]] = ray.get(r)
                if progress:
                    progress(1)
        return results


def make_executor(kind: str = "local", workers: int | None = None, ray_address: str | None = None):
    if kind == "local":
        if ray_address:
            raise MetronomeError("--ray-address needs --executor ray")
        return LocalExecutor(workers)
    if kind == "ray":
        return RayExecutor(ray_address, workers)
    raise MetronomeError(f"unknown executor {kind!r} (one of {', '.join(EXECUTORS)})")
