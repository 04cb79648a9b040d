"""Open a checkpoint file of any supported format, told apart by its first bytes, not its name.

`read_tensors(path)` gives a TensorFile: the named tensors (read-only numpy views of the file),
the format's metadata, plain values stored beside a pickled state dict (a Lightning
checkpoint's global_step) and the file's sha256 on demand. safetensors and torch's zip format
(.ckpt/.pt/.bin) are read; anything else (an old-format torch pickle, a GGUF file, an image, a
text file) is one UserError saying what the file is. What a failed download leaves in a
checkpoint's place (a Git LFS pointer, a web page, a server's error message) is named as such,
with what to do (`failed_download`).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from .pickle_file import read_torch_zip
from .safetensors_file import MAX_HEADER, read_safetensors

# torch.save's pre-1.6 format starts with this number, pickled as a 10-byte long.
_LEGACY_TORCH_MAGIC = 0x1950A86A20F9469CFC6C
_ACCEPTED = "a .safetensors file or a torch .ckpt/.pt checkpoint"


@dataclass
class TensorFile:
    path: Path
    format: str  # "safetensors" or "torch-zip"
    tensors: dict[str, np.ndarray]
    metadata: dict = field(default_factory=dict)  # safetensors' __metadata__
    extras: dict = field(default_factory=dict)  # plain values beside a pickled state dict
    _sha256: str | None = None

    def sha256(self) -> str:
        """The file's sha256 (hex), read in blocks once and remembered."""
        if self._sha256 is None:
            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
            self._sha256 = h.hexdigest()
        return self._sha256


def sniff(path: Path) -> str:
    """The format of a file from its first bytes: "safetensors" or "torch-zip"; UserError for
    anything else."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a checkpoint file")
    size, head = _head(path)
    if size == 0:
        raise UserError(f"{path} is empty; re-download it")
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "torch-zip"
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if n <= MAX_HEADER:
            return "safetensors"
    if head[:1] == b"\x80" and head[2:4] == b"\x8a\x0a" and _is_legacy_magic(head[4:14]):
        raise UserError(
            f"{path} is an old-format torch checkpoint (from before torch 1.6), which "
            "sdiree does not read; re-save it with a current torch or convert it to "
            ".safetensors"
        )
    if head.startswith(b"\x80"):
        raise UserError(
            f"{path} is a bare Python pickle, not {_ACCEPTED}; convert it to .safetensors"
        )
    if head.startswith(b"GGUF"):
        raise UserError(f"{path} is a GGUF file, which sdiree does not read; pass {_ACCEPTED}")
    if problem := failed_download(path):
        raise UserError(problem)
    if path.suffix.lower() in (".safetensors", ".ckpt", ".pt", ".pth", ".bin"):
        raise UserError(
            f"{path} is not a checkpoint, though its name says one: its first bytes are "
            "neither a safetensors header nor a torch zip file; it is damaged: re-download it"
        )
    raise UserError(f"{path} is not a checkpoint sdiree reads; pass {_ACCEPTED}")


_TEXT_HEAD = 512  # bytes read to tell a text file from a checkpoint


def _head(path: Path, n: int = 16) -> tuple[int, bytes]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            return size, f.read(n)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e})") from None


def failed_download(path: Path) -> str | None:
    """What path is, where it is what a failed download leaves in a checkpoint's place (a Git
    LFS pointer, an HTML page, a JSON or other text message), as one line saying what to do;
    None for anything else. Reads at most 512 bytes."""
    path = Path(path)
    size, head = _head(path, _TEXT_HEAD)
    if head.startswith(b"version https://git-lfs"):
        stated = re.search(rb"\nsize (\d+)", head)
        real = f" of {_gb(int(stated[1]))}" if stated else ""
        return (
            f"{path} is a Git LFS pointer ({size} bytes), not the file{real} itself: its "
            "repository was cloned without git-lfs; run `git lfs install && git lfs pull` "
            "there, or download the file"
        )
    try:
        text = head.decode("utf-8").lstrip("\ufeff \t\r\n")
    except UnicodeDecodeError as e:  # a multi-byte character cut at the end still counts
        if e.start < len(head) - 3:
            return None
        text = head[: e.start].decode("utf-8").lstrip("\ufeff \t\r\n")
    if not text or not all(c.isprintable() or c in "\t\r\n" for c in text):
        return None
    if text[:1] == "<":
        kind = "a web page (HTML)"
    elif text[:1] in "{[":
        kind = "a JSON text"
    else:
        kind = "a text file"
    start = " ".join(text.split())[:60]
    return (
        f"{path} is {kind}, not a checkpoint ({size} bytes, starting {start!r}): a download "
        "that saved a server's page or error message instead of the file (some model sites "
        "need you to be logged in, or an API token); download it again"
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _is_legacy_magic(raw: bytes) -> bool:
    return len(raw) == 10 and int.from_bytes(raw, "little") == _LEGACY_TORCH_MAGIC


def read_tensors(path: Path) -> TensorFile:
    """The tensors of a checkpoint file, its format found from its content."""
    path = Path(path)
    fmt = sniff(path)
    if fmt == "safetensors":
        tensors, metadata = read_safetensors(path)
        return TensorFile(path=path, format=fmt, tensors=tensors, metadata=metadata)
    tensors, extras = read_torch_zip(path)
    return TensorFile(path=path, format=fmt, tensors=tensors, extras=extras)
