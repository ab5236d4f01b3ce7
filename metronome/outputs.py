"""Where every command's results go, and the one rule for an ``--out`` that already holds some.

The rule: an ``--out`` that exists and is not empty is refused (one line, exit 2) before any work, unless
the user passes ``--replace`` (the new results replace the old ones whole, and only once they are complete)
or, for a command that can continue an interrupted run, ``--resume``. :func:`check_out` says so, and every
command calls it first.

Results are written whole: :func:`atomic_dir` writes into a temporary folder beside the target and renames
that folder into place when everything succeeded. Commands that write as they run (the live probes) write
straight into a new ``--out`` so an interrupted run keeps what it measured, or into a temporary folder that
replaces the old one at the end with ``--replace`` (:func:`run_dir`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from metronome.errors import MetronomeError


def _holds_results(p: Path) -> bool:
    if p.is_dir():
        return any(p.iterdir())
    return p.exists()


def check_out(out: str | Path, replace: bool | None = False, resume: bool | None = None, file: bool = False) -> Path:
    """Refuse ``out`` unless it may receive this command's results; call it before any work.

    ``resume`` is None for a command that cannot continue a run, else whether ``--resume`` was given; ``replace``
    is None for one that never overwrites (a benchmark), else whether ``--replace`` was given. ``file``: the command writes one file at ``out`` rather than a folder."""
    p = Path(out)
    if replace and resume:
        raise MetronomeError("--replace and --resume: pass one (replace the run in --out, or continue it)")
    if file and p.is_dir():
        raise MetronomeError(f"--out {p}: is a folder; give a file name")
    if not file and p.exists() and not p.is_dir():
        raise MetronomeError(f"--out {p}: exists and is not a folder")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise MetronomeError(f"--out {p}: {parent} is not a folder")
            break
    if replace or resume or not _holds_results(p):
        return p
    if replace is None:
        ways = "choose another --out"
    else:
        ways = "pass --replace to overwrite it" + (" or --resume to continue it" if resume is not None else "")
    raise MetronomeError(f"{p} already holds results; {ways}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_dir(out: str | Path, replace: bool = False) -> Iterator[Path]:
    """``with atomic_dir(out) as tmp:`` write files into ``tmp``; on success ``tmp`` becomes ``out``.

    ``out`` must not hold results unless ``replace``; then the old folder is renamed aside, the new one renamed
    in and the old one removed, so nothing of the old run survives. On any error the temporary folder is
    removed and ``out`` is as it was."""
    out = check_out(out, replace=replace)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's folder is private; results are not
        yield tmp
        if replace and out.exists():
            _swap_in(tmp, out)
        else:
            try:
                os.rename(tmp, out)  # also takes the place of an empty folder
            except OSError as exc:  # something wrote into out while we ran
                raise MetronomeError(f"{out} already holds results; pass --replace to overwrite it") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(new: Path, out: Path) -> None:
    """Rename ``out`` aside, ``new`` into its place, then remove the old one; put ``out`` back on failure."""
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        old = aside / out.name
        os.rename(out, old)
        try:
            os.rename(new, out)
        except BaseException:
            os.rename(old, out)
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def run_dir(out: str | Path, replace: bool = False) -> Iterator[Path]:
    """The folder a command that writes as it runs writes into.

    Without ``replace`` it is ``out`` itself (created here), so an interrupted run keeps what it wrote; with
    ``replace`` it is an :func:`atomic_dir`, which replaces ``out`` only when the run ends without error."""
    if replace:
        with atomic_dir(out, replace=True) as tmp:
            yield tmp
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    yield out


def _json_default(o):
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"cannot write {type(o).__name__} as JSON")


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")


def write_outputs(out: str | Path, files: dict[str, Any], replace: bool = False) -> Path:
    """Write ``{"name.json": obj, "table": DataFrame, ...}`` into ``out`` atomically (see :func:`atomic_dir`).

    ``*.json`` entries are written as JSON; any other entry is a DataFrame written as ``name.parquet``
    and ``name.csv``."""
    with atomic_dir(out, replace) as tmp:
        for name, value in files.items():
            if name.endswith(".json"):
                write_json(tmp / name, value)
            else:
                value.to_parquet(tmp / f"{name}.parquet", index=False)
                value.to_csv(tmp / f"{name}.csv", index=False)
    return Path(out)
