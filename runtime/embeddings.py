"""Textual-inversion embeddings from the files users bring, read without torch.

Formats (told apart by their tensors, the file read by sdiree.runtime.checkpoints: safetensors,
or torch's zip pickle through its restricted unpickler):
- AUTOMATIC1111 `.pt`: a dict whose `string_to_param` holds one tensor [N, D];
- AUTOMATIC1111 `.safetensors`: one tensor `emb_params` [N, D];
- diffusers `learned_embeds.safetensors` / `.bin`: one tensor [D] or [N, D] named by its token
  (`{"<cat-toy>": ...}`);
- SDXL (`.safetensors`): `clip_l` [N, 768] for the first text encoder (CLIP ViT-L) and `clip_g`
  [N, 1280] for the second (OpenCLIP bigG), each set fed to its own encoder (the family's
  `text_encoders[i].embedding` in specs/families.json names which), as diffusers'
  `load_textual_inversion(..., text_encoder=..., tokenizer=...)` loads them one per encoder.
An embedding of N vectors stands for N tokens in a row, as diffusers' `<t> <t>_1 ... <t>_N-1`.
An SDXL embedding on an SD 1.x/2.x model, or one of those on an SDXL model, is refused in one
line when the artifact's text encoders are set up (`vectors_for`).

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

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .checkpoints import read_tensors
from .errors import UserError

A1111_KEY = "string_to_param"  # nested in a .pt: its one entry, "*"
A1111_SAFETENSORS_KEY = "emb_params"
SDXL_KEYS = ("clip_l", "clip_g")  # one vector set per text encoder, in the encoders' order


@dataclass(frozen=True)
class Embedding:
    path: Path
    name: str  # as the PNG parameters name it
    vectors: np.ndarray  # [N, D] float32 (SDXL: the first set, clip_l)
    words: tuple[tuple[str, bool], ...]  # (text, whole word only) that call it in a prompt
    sha256: str
    # SDXL: {"clip_l": [N, 768], "clip_g": [N, 1280]}, one set per text encoder; else empty
    per_encoder: dict = field(default_factory=dict)

    def vectors_for(self, key: str | None, model: str) -> np.ndarray:
        """The vectors for a text encoder: key None for an SD 1.x/2.x model's only one, else
        the family's name of the set (clip_l, clip_g); model names the model in refusals."""
        if key is None and self.per_encoder:
            raise UserError(
                f"--embedding {self.path} is an SDXL embedding ({'/'.join(self.per_encoder)} "
                f"vectors), but this is an {model} model; use an embedding made for {model}"
            )
        if key is None:
            return self.vectors
        if not self.per_encoder:
            raise UserError(
                f"--embedding {self.path} holds one set of vectors (an SD 1.x/2.x embedding), "
                f"but this {model} model's text encoders each take their own "
                f"({', '.join(SDXL_KEYS)}); use an embedding made for {model}"
            )
        if key not in self.per_encoder:
            raise UserError(
                f"--embedding {self.path} has no {key} vectors, which this {model} model's "
                "text encoders need"
            )
        return self.per_encoder[key]

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
    per_encoder = _sdxl_vectors(path, tf.tensors)
    if per_encoder:
        vectors, own_token = per_encoder[SDXL_KEYS[0]], None
    else:
        raw, own_token = _find_vectors(path, tf.tensors)
        vectors = _as_vectors(path, raw)
    if token is not None:
        words = ((token, False),)
    elif own_token is not None:
        words = ((own_token, False),)
    else:
        words = ((path.stem, True), (f"<{path.stem}>", False))
    return Embedding(path, words[0][0], vectors, words, tf.sha256(), per_encoder)


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


def _sdxl_vectors(path: Path, tensors: dict) -> dict[str, np.ndarray]:
    """{"clip_l": ..., "clip_g": ...} of an SDXL embedding; {} for another kind of file."""
    found = [k for k in SDXL_KEYS if k in tensors]
    if not found:
        return {}
    missing = [k for k in SDXL_KEYS if k not in tensors]
    if missing:
        raise UserError(
            f"--embedding {path} has {found[0]} vectors but no {missing[0]}: an SDXL embedding "
            f"holds both ({', '.join(SDXL_KEYS)}), one set per text encoder; re-download it"
        )
    extra = sorted(set(tensors) - set(SDXL_KEYS))
    if extra:
        raise UserError(
            f"--embedding {path} holds {extra[0]} besides {', '.join(SDXL_KEYS)}; not one "
            "SDXL textual-inversion embedding"
        )
    out = {k: _as_vectors(path, tensors[k], f" ({k})") for k in SDXL_KEYS}
    counts = {k: v.shape[0] for k, v in out.items()}
    if len(set(counts.values())) > 1:
        raise UserError(
            f"--embedding {path}: its vector sets differ in count ({counts}); an SDXL embedding "
            "has as many for each text encoder"
        )
    return out


def _as_vectors(path: Path, raw: np.ndarray, what: str = "") -> np.ndarray:
    if raw.dtype.kind in "biuc":
        raise UserError(f"--embedding {path}{what} holds {raw.dtype} values, not floating point")
    if raw.ndim == 1:
        raw = raw[None, :]
    if raw.ndim != 2 or raw.shape[0] < 1 or raw.shape[1] < 1:
        raise UserError(
            f"--embedding {path}{what} holds a tensor of shape {list(raw.shape)}; an embedding is "
            "[vectors, width] or [width]"
        )
    vectors = np.asarray(raw, dtype=np.float32)
    if not np.isfinite(vectors).all():
        raise UserError(f"--embedding {path}{what} holds NaN or infinite values; re-download it")
    return np.ascontiguousarray(vectors)


def ti_hashes(used: list[Embedding]) -> str | None:
    """The PNG parameters' "TI hashes" as AUTOMATIC1111 writes them: `name: short hash` of each
    embedding the prompts used, once each, ':' and ',' taken out of names; None for none."""
    pairs = {e.name.replace(":", "").replace(",", ""): e.short_hash for e in used}
    return ", ".join(f"{name}: {h}" for name, h in pairs.items()) or None
