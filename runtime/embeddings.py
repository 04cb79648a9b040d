"""Textual-inversion embeddings from the files users bring, read without torch.

Formats (told apart by their tensors, the file read by sdiree.runtime.checkpoints: safetensors,
or torch's zip pickle through its restricted unpickler):
- AUTOMATIC1111 `.pt`: a dict whose `string_to_param` holds one tensor [N, D];
- AUTOMATIC1111 `.safetensors`: one tensor `emb_params` [N, D];
- diffusers `learned_embeds.safetensors` / `.bin`: one tensor [D] or [N, D] named by its token
  (`{"<cat-toy>": ...}`).
An embedding of N vectors stands for N tokens in a row, as diffusers' `<t> <t>_1 ... <t>_N-1`.

The words that call an embedding in a prompt (`--embedding FILE[:TOKEN]`):
- `FILE:TOKEN`: TOKEN alone, matched as diffusers' `load_textual_inversion(FILE, token=TOKEN)`
  adds it (anywhere in the prompt, case-insensitive);
- `FILE` of diffusers' format: the token the file names, as diffusers uses it (its files are
  all called learned_embeds, so their names say nothing);
- `FILE` of A1111's formats: the file's stem as a word of its own, as AUTOMATIC1111 uses it
  (`my-cat`, not inside `my-cats`), and `<stem>` in angle brackets anywhere.
The PNG parameters name an embedding by its first word (the stem for A1111's formats), with
A1111's short hash of the file (`TI hashes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoints import read_tensors
from .errors import UserError

A1111_KEY = "string_to_param"  # nested in a .pt: its one entry, "*"
A1111_SAFETENSORS_KEY = "emb_params"


@dataclass(frozen=True)
class Embedding:
    path: Path
    name: str  # as the PNG parameters name it
    vectors: np.ndarray  # [N, D] float32
    words: tuple[tuple[str, bool], ...]  # (text, whole word only) that call it in a prompt
    sha256: str

    @property
    def short_hash(self) -> str:
        """AUTOMATIC1111's hash of an embedding: the first 12 hex digits of its file's sha256."""
        return self.sha256[:12]


def parse_embedding_option(text: str) -> tuple[Path, str | None]:
    """(file, token or None) of `--embedding FILE[:TOKEN]`. The last colon starts the token
    unless the whole text names an existing file, or a slash follows it and what is before it
    is no file (C:\\...)."""
    path, sep, token = text.rpartition(":")
    slash = "/" in token or "\\" in token
    if not sep or Path(text).exists() or (slash and not Path(path).is_file()):
        return Path(text), None
    if not token.strip():
        raise UserError(f"--embedding {text}: the token after ':' is empty; write FILE:TOKEN")
    return Path(path), token


def load_embedding(path: Path, token: str | None = None) -> Embedding:
    """The embedding in path, called by token (or by its default words, see the module doc)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"--embedding {path}: no such file"
            if not path.exists()
            else f"--embedding {path} is not a file"
        )
    tf = _read(path)
    raw, own_token = _find_vectors(path, tf.tensors)
    vectors = _as_vectors(path, raw)
    if token is not None:
        words = ((token, False),)
    elif own_token is not None:
        words = ((own_token, False),)
    else:
        words = ((path.stem, True), (f"<{path.stem}>", False))
    return Embedding(path, words[0][0], vectors, words, tf.sha256())


def load_embeddings(options: list[str]) -> list[Embedding]:
    """Every `--embedding` option's embedding, in order; one given twice is refused."""
    out, seen = [], set()
    for text in options:
        path, token = parse_embedding_option(text)
        key = (path.resolve(), token)
        if key in seen:
            raise UserError(f"--embedding {text} is given twice; give it once")
        seen.add(key)
        out.append(load_embedding(path, token))
    return out


def _read(path: Path):
    try:
        return read_tensors(path)
    except UserError as e:
        raise UserError(f"--embedding: {e}") from None


def _find_vectors(path: Path, tensors: dict) -> tuple[np.ndarray, str | None]:
    """The embedding's tensor and the token the file names for it (diffusers' files only)."""
    a1111 = [k for k in tensors if k == A1111_KEY or k.startswith(A1111_KEY + ".")]
    if len(a1111) == 1:
        return tensors[a1111[0]], None
    if len(a1111) > 1:
        raise UserError(
            f"--embedding {path} holds {len(a1111)} embeddings in {A1111_KEY}; sdiree takes "
            "files with one (as AUTOMATIC1111 does)"
        )
    if "clip_l" in tensors or "clip_g" in tensors:
        raise UserError(
            f"--embedding {path} is an SDXL embedding (clip_l/clip_g vectors), not one for this "
            "model's text encoder; use an embedding made for SD 1.x/2.x"
        )
    if len(tensors) == 1:
        ((key, value),) = tensors.items()
        return value, None if key in (A1111_SAFETENSORS_KEY, "*") else key
    if not tensors:
        raise UserError(f"--embedding {path} holds no tensors: not a textual-inversion embedding")
    names = ", ".join(sorted(tensors)[:3]) + (", ..." if len(tensors) > 3 else "")
    raise UserError(
        f"--embedding {path} holds {len(tensors)} tensors ({names}), not one "
        "textual-inversion embedding; is it a LoRA (--lora) or a checkpoint (--weights)?"
    )


def _as_vectors(path: Path, raw: np.ndarray) -> np.ndarray:
    if raw.dtype.kind in "biuc":
        raise UserError(f"--embedding {path} holds {raw.dtype} values, not floating point")
    if raw.ndim == 1:
        raw = raw[None, :]
    if raw.ndim != 2 or raw.shape[0] < 1 or raw.shape[1] < 1:
        raise UserError(
            f"--embedding {path} holds a tensor of shape {list(raw.shape)}; an embedding is "
            "[vectors, width] or [width]"
        )
    vectors = np.asarray(raw, dtype=np.float32)
    if not np.isfinite(vectors).all():
        raise UserError(f"--embedding {path} holds NaN or infinite values; re-download it")
    return np.ascontiguousarray(vectors)


def ti_hashes(used: list[Embedding]) -> str | None:
    """The PNG parameters' "TI hashes" as AUTOMATIC1111 writes them: `name: short hash` of each
    embedding the prompts used, once each, ':' and ',' taken out of names; None for none."""
    pairs = {e.name.replace(":", "").replace(",", ""): e.short_hash for e in used}
    return ", ".join(f"{name}: {h}" for name, h in pairs.items()) or None
