"""Open a checkpoint file of any supported format, told apart by its first bytes, not its name.

`read_tensors(path)` gives a TensorFile: the named tensors (read-only numpy views of the file),
the format's metadata, plain values stored beside a pickled state dict (a Lightning
checkpoint's global_step) and the file's sha256 on demand. safetensors and torch's zip format
(.ckpt/.pt/.bin) are read; anything else (an old-format torch pickle, a GGUF file, an image, a
text file) is one UserError saying what the file is.
"""

from __future__ import annotations

import hashlib
import os
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
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e})") from None
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
    raise UserError(f"{path} is not a checkpoint sdiree reads; pass {_ACCEPTED}")


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
