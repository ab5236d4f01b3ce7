"""Output folders written all at once: nothing half-written is ever left behind.

Files go into a temporary folder beside the target and are moved into place only when everything
succeeded; on any error the temporary folder is removed and the target is left as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """``with atomic_dir(out) as tmp:`` write files into ``tmp``; they land in ``out`` on success."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        out.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _json_default(o):
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"cannot write {type(o).__name__} as JSON")


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")


def write_outputs(out: str | Path, files: dict[str, Any]) -> Path:
    """Write ``{"name.json": obj, "table": DataFrame, ...}`` into ``out`` atomically.

    ``*.json`` entries are written as JSON; any other entry is a DataFrame written as ``name.parquet``
    and ``name.csv``."""
    with atomic_dir(out) as tmp:
        for name, value in files.items():
            if name.endswith(".json"):
                write_json(tmp / name, value)
            else:
                value.to_parquet(tmp / f"{name}.parquet", index=False)
                value.to_csv(tmp / f"{name}.csv", index=False)
    return Path(out)
