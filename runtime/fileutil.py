"""File helpers shared by compile and run: atomic writes, hashing, stale temp cleanup.

Every file sdiree produces is written to a temporary name in the same directory and renamed
into place, so a killed process never leaves a half-written file under a real name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

_TMP_RE = re.compile(r"^\..+\.(\d+)\.tmp(\.\w+)?$")


def temp_path_for(path: Path) -> Path:
    # Keep the suffix last: some writers (turbine's .irpa saver) insist on it.
    return path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; rename it onto `path` if the block succeeds."""
    path = Path(path)
    tmp = temp_path_for(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_copy(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete temp files left by killed sdiree processes (their pid is gone) in directory."""
    removed = []
    if not Path(directory).is_dir():
        return removed
    for p in Path(directory).iterdir():
        m = _TMP_RE.match(p.name)
        if m and p.is_file() and not _pid_alive(int(m.group(1))):
            p.unlink()
            removed.append(p)
    return removed
