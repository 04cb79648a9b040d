"""File helpers shared by compile and run: atomic writes, hardlinks, hashing, stale temps.

Every file sdiree produces is written to a temporary name in the same directory and renamed
into place, so a killed process never leaves a half-written file under a real name. A file's
sha256 can be cached under its stamp (size, mtime, ctime, inode): ctime and inode change with
any rewrite and, unlike mtime, cannot be set back (`touch -d`, os.utime).
"""

from __future__ import annotations

import contextlib
import errno
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


def link_or_copy(src: Path, dst: Path) -> None:
    """Put src's bytes at dst atomically: a hardlink (no disk) where both are on one filesystem
    that allows it, else a copy. Nothing happens when dst already is src."""
    with contextlib.suppress(OSError):
        if os.path.samefile(src, dst):
            return
    with atomic_path(dst) as tmp:
        tmp.unlink(missing_ok=True)  # left by an earlier process with this pid: link won't replace
        try:
            os.link(src, tmp)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
            shutil.copyfile(src, tmp)


def file_stamp(path: Path) -> list[int]:
    """[size, mtime_ns, ctime_ns, inode]: changes whenever the file's bytes may have."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def cached_sha256(path: Path, key: str, cache: dict) -> str:
    """sha256 of path, taken from cache[key] while the file's stamp is the one recorded there;
    otherwise hashed again and recorded."""
    stamp = file_stamp(path)
    hit = cache.get(key)
    if isinstance(hit, list) and len(hit) == len(stamp) + 1 and hit[:-1] == stamp:
        return hit[-1]
    digest = sha256_file(path)
    cache[key] = [*stamp, digest]
    return digest


def read_json_dict(path: Path) -> dict:
    """The JSON object in path, or {} where it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def user_cache_dir() -> Path:
    """sdiree's per-user cache: `$SDIREE_CACHE`, else `${XDG_CACHE_HOME:-~/.cache}/sdiree`."""
    if os.environ.get("SDIREE_CACHE"):
        return Path(os.environ["SDIREE_CACHE"]).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser().absolute() / "sdiree"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: Path, include_own: bool = False) -> list[Path]:
    """Delete temp files (and temp folders: compile/iree_compile.py's SPIR-V rewrite) left by
    killed sdiree processes (their pid is gone) in directory; with include_own also those named
    with this process's pid (a caller that is writing none: in a container a new process often
    gets the pid of an old one)."""
    removed = []
    if not Path(directory).is_dir():
        return removed
    for p in Path(directory).iterdir():
        m = _TMP_RE.match(p.name)
        pid = int(m.group(1)) if m else 0
        if not m or not ((include_own and pid == os.getpid()) or not pid_alive(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file():
            p.unlink(missing_ok=True)  # another process may be cleaning the same directory
        else:
            continue
        removed.append(p)
    return removed
