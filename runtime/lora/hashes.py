"""The LoRA hashes A1111 writes into images: ``Lora hashes: "name: 0123456789ab, ..."``.

A1111 (after kohya's sd-scripts and the additional-networks extension) hashes a LoRA's
.safetensors file with sha256 over the bytes after the header (the 8-byte header length and
the JSON header are skipped, so editing the metadata keeps the hash), and writes its first 12
hex digits after the name the prompt used, with ``:`` and ``,`` removed from that name,
entries joined by ``", "``. The PNG writer quotes the value (it holds colons).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from ..errors import UserError

SHORT = 12
_CHUNK = 1 << 20


def addnet_hash(path: Path) -> str:
    """sha256 (hex) of a .safetensors file's tensor data, as A1111 computes it for LoRAs."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n + 8 > size:
            raise UserError(f"{path} is not a .safetensors file (no complete header)")
        f.seek(n + 8)
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def lora_short_hash(path: Path) -> str:
    """The 12-digit hash A1111 shows for a LoRA file."""
    return addnet_hash(path)[:SHORT]


def lora_hashes_value(entries: Iterable[tuple[str, str]]) -> str:
    """The ``Lora hashes`` value for (name, short hash) pairs, unquoted; a name given twice is
    written once, at its first place (A1111 keeps them in a dict)."""
    named: dict[str, str] = {}
    for name, short in entries:
        named.setdefault(name.replace(":", "").replace(",", ""), short)
    return ", ".join(f"{name}: {short}" for name, short in named.items())
