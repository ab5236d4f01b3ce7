"""Where every command's results go, and the one rule for an ``--out`` that already holds something.

The rule: ``--out`` never loses a file Metronome did not write.

* Every folder a command writes is **marked**: a small ``.metronome.json`` in it names the command, Metronome's
  version and when, and lists what the command wrote there (:data:`MARKER`). A command that writes one file
  (``metronome-probe pool``) writes a JSON object and stamps it with the same facts under ``"written_by"``
  (:func:`stamped`).
* An ``--out`` that holds anything Metronome did not write is refused, with or without ``--replace`` (one line,
  exit 2): a folder without a marker (a user's folder, or results of a Metronome from before folders were
  marked), a marked folder into which something was put since, a file without the stamp.
* An ``--out`` that is or contains the working directory, Metronome's own folder, the user's home or the
  filesystem root is refused whatever it holds.
* What is ours and not empty is refused too, unless the user passes ``--replace`` (the new results replace the
  old ones whole, and only once they are complete) or, for a command that can continue an interrupted run,
  ``--resume``.

:func:`check_out` says all this before any work, and every command calls it first. Results are written whole:
:func:`atomic_dir` writes into a temporary folder beside the target, marks it and renames it into place when
everything succeeded. Commands that write as they run (the live probes) write straight into a new ``--out``,
marked as they create it so that a run interrupted midway is still recognisably ours, or into a temporary folder
that replaces the old one at the end with ``--replace`` (:func:`run_dir`).

Why the marker lists the files (a manifest) rather than only saying "ours": a user drops notes into a results
folder, or keeps a script beside a report. A marker alone would let ``--replace`` delete those with the results.
With the list, anything not on it is the user's, and the folder is refused instead. The list holds names, not
contents: a results file the user edited is still the file the command wrote there and promises to replace.
A marker whose list is null belongs to a run that never ended (killed, or a server or benchmark that writes until
it is stopped): that folder was created by Metronome and is taken as ours whole, since nothing else could
say which of its files a later run added.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from metronome.errors import MetronomeError

MARKER = ".metronome.json"  # in every folder a command writes
_MARKER_TMP = MARKER + ".partial"  # the marker is replaced whole, never half-written
STAMP_KEY = "written_by"  # in a one-file output: the same facts as the marker, minus the list

_command: str | None = None


@contextmanager
def writing_as(command: str) -> Iterator[None]:
    """Every marker and stamp written inside names ``command`` (``metronome-sim run``). Set once per command, by
    :func:`metronome.errors.run_command`, so no caller restates it."""
    global _command
    before, _command = _command, command
    try:
        yield
    finally:
        _command = before


def stamp() -> dict[str, str]:
    """Who wrote an output: Metronome, the command (the script's name outside a CLI), the version, when."""
    from metronome import __version__

    return {"program": "metronome", "command": _command or Path(sys.argv[0]).name or "python",
            "version": __version__, "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def stamped(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as a command that writes one JSON file writes it: with :func:`stamp` under ``"written_by"``, which
    is how :func:`check_out` knows, next time, that the file is ours to replace."""
    return {**obj, STAMP_KEY: stamp()}


def _is_stamp(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("program") == "metronome"


def _entries(root: Path) -> list[str]:
    """Every file and folder under ``root`` (relative, ``/``-separated, links not followed), but the marker."""
    found = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        found += [(rel / name).as_posix() for name in dirs + files]
    return sorted(e for e in found if e not in (MARKER, _MARKER_TMP))


def _marker(folder: Path) -> dict | None:
    """The folder's marker, or None when it has none (or one that is not Metronome's)."""
    try:
        m = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    files = m.get("files") if isinstance(m, dict) else None
    if not _is_stamp(m) or not (files is None or isinstance(files, list) and all(isinstance(f, str) for f in files)):
        return None
    return m


def _mark(folder: Path, files: list[str] | None, earlier: dict | None = None) -> None:
    """Write ``folder``'s marker: who wrote it and ``files`` (None while a run is still writing). A resumed run
    keeps the first run's command, version and time, so the marker changes only where the folder did."""
    kept = {k: earlier[k] for k in ("command", "version", "written_at") if k in (earlier or {})}
    tmp = folder / _MARKER_TMP
    tmp.write_text(json.dumps({**stamp(), **kept, "files": files}, indent=2) + "\n")
    os.replace(tmp, folder / MARKER)


def _not_ours(folder: Path) -> tuple[list[str], bool]:
    """What in ``folder`` Metronome did not write, and whether the folder is marked at all."""
    m = _marker(folder)
    if m is None:  # none of it is ours: its top level says so (never walk a big tree of someone else's)
        return sorted(e.name for e in folder.iterdir()), False
    if m["files"] is None:  # a run that never ended: see the module's docstring
        return [], True
    listed = set(m["files"])
    return [e for e in _entries(folder) if e not in listed], True


def _stamped_file(p: Path) -> bool:
    if not p.is_file() or p.stat().st_size > 64 * 2**20:  # ours are small JSON objects; never read a huge file
        return False
    try:
        obj = json.loads(p.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and _is_stamp(obj.get(STAMP_KEY))


def _refusal(p: Path, foreign: list[str], marked: bool) -> MetronomeError:
    alien = set(foreign)
    tops = [e + "/" * (p / e).is_dir() for e in foreign  # a foreign folder is named once, not with its contents
            if not any(a.as_posix() in alien for a in Path(e).parents)]
    shown = ", ".join(tops[:3]) + (f" and {len(tops) - 3} more" if len(tops) > 3 else "")
    if marked:
        return MetronomeError(f"{p} holds files Metronome did not write ({shown}); move them out of it or choose "
                              "another --out")
    return MetronomeError(f"{p} holds files Metronome did not write ({shown}; no {MARKER}); choose another --out "
                          "(results of a Metronome from before it marked its folders: remove the folder by hand)")


def _places() -> list[tuple[str, Path]]:
    """Folders an ``--out`` must never be or contain: replacing one would take far more than results with it."""
    pkg = Path(__file__).resolve().parent
    places = [("the filesystem root", Path(Path(pkg).anchor))]
    try:
        places.append(("the working directory", Path.cwd().resolve()))
    except OSError:  # (a working directory removed under us contains nothing)
        pass
    try:
        places.append(("your home folder", Path.home().resolve()))
    except (RuntimeError, KeyError, OSError):  # (no home: nothing to protect)
        pass
    # the checkout (an editable install: the repository) or site-packages, and the package itself
    places += [("the folder Metronome is installed in", pkg.parent), ("Metronome's own package", pkg)]
    return places


def _hazard(p: Path) -> str | None:
    r = p.resolve()  # absolute, links followed: `--out .`, `--out ..` and a link to home are caught alike
    for what, place in _places():
        if place == r or r in place.parents:
            return (f"--out {p}: is or contains {what} ({place}); results need a folder of their own, e.g. "
                    "--out runs/NAME")
    return None


def check_out(out: str | Path, replace: bool | None = False, resume: bool | None = None, file: bool = False) -> Path:
    """Refuse ``out`` unless it may receive this command's results; call it before any work.

    ``resume`` is None for a command that cannot continue a run, else whether ``--resume`` was given; ``replace``
    is None for one that never overwrites (a benchmark), else whether ``--replace`` was given. ``file``: the
    command writes one file at ``out`` rather than a folder. What Metronome did not write is refused whatever
    the flags (see the module's docstring)."""
    p = Path(out)
    if replace and resume:
        raise MetronomeError("--replace and --resume: pass one (replace the run in --out, or continue it)")
    hazard = _hazard(p)
    if hazard:
        raise MetronomeError(hazard)
    if file and p.is_dir():
        raise MetronomeError(f"--out {p}: is a folder; give a file name")
    if not file and p.exists() and not p.is_dir():
        raise MetronomeError(f"--out {p}: exists and is not a folder")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise MetronomeError(f"--out {p}: {parent} is not a folder")
            break
    if not p.exists() or (p.is_dir() and not any(p.iterdir())):
        return p
    if file:
        if not _stamped_file(p):
            raise MetronomeError(f"{p} is a file Metronome did not write (no \"{STAMP_KEY}\" in it); choose another "
                                 "--out")
    else:
        foreign, marked = _not_ours(p)
        if foreign:
            raise _refusal(p, foreign, marked)
    if replace or resume:
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
    """``with atomic_dir(out) as tmp:`` write files into ``tmp``; on success ``tmp`` is marked and becomes ``out``.

    ``out`` must not hold results unless ``replace``, nor anything Metronome did not write at all; with
    ``replace`` the old folder is renamed aside, the new one renamed in and the old one removed, so nothing of
    the old run survives. On any error the temporary folder is removed and ``out`` is as it was."""
    out = check_out(out, replace=replace)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's folder is private; results are not
        yield tmp
        _mark(tmp, _entries(tmp))  # before the rename: the folder is never in place unmarked
        if replace and out.exists():
            check_out(out, replace=True)  # what the user put there while we ran is refused, not removed
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


def start_dir(out: str | Path) -> Path:
    """Create ``out`` (if need be) and mark it as a run in progress, for a command that writes into it as it
    runs and has no end to mark (a server, a benchmark). The caller has called :func:`check_out`; this refuses
    what nobody may write into, whatever the caller decided."""
    out = check_out(out, resume=True)  # (resume: a folder of ours may be continued; the caller said whether)
    out.mkdir(parents=True, exist_ok=True)
    _mark(out, None, _marker(out))
    return out


@contextmanager
def run_dir(out: str | Path, replace: bool = False) -> Iterator[Path]:
    """The folder a command that writes as it runs writes into.

    Without ``replace`` it is ``out`` itself, marked before anything is written in it (:func:`start_dir`), so
    an interrupted run keeps what it wrote and the folder stays recognisably ours; when the run ends, by
    success, error or Ctrl-C, the marker lists what is there. With ``replace`` it is an :func:`atomic_dir`,
    which replaces ``out`` only when the run ends without error."""
    if replace:
        with atomic_dir(out, replace=True) as tmp:
            yield tmp
        return
    out = start_dir(out)
    mark = _marker(out)  # (a resumed run's first command and time, kept)
    try:
        yield out
    finally:
        if out.is_dir():  # (a run may remove the folder it made, having nothing to keep)
            _mark(out, _entries(out), mark)


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
