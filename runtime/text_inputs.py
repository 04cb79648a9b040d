"""Prompt text → the inputs of an artifact's compiled text encoder, embeddings included.

The text encoder exported since EXPORTER_REVISION 9 takes token embeddings (`inputs_embeds`
[B, L, D], before position embeddings) and the end-of-text positions (`eos_index` [B]); older
artifacts take the ids (`input_ids` [B, L]). The ids come from the tokenizer, which also knows
the words of the textual-inversion embeddings given (each of N vectors gets an id past the
vocabulary, in the order given, as diffusers' `load_textual_inversion` adds them); the
embeddings are rows of the token-embedding table (read from the text encoder's parameter
archive through a read-only memory map, never copied) or the embedding's own vectors, cast to
the table's dtype as diffusers casts them. The lookup is exact, so a prompt without embeddings
gives the encoder the values its own table lookup gave. An SDXL embedding gives each of the two
encoders its own vector set (the family's `text_encoders[i].embedding`: clip_l, clip_g) under
the same words, so both tokenizers give the same new ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .embeddings import Embedding
from .errors import UserError
from .manifest import FunctionDecl, Manifest
from .tokenizer import AddedText, ClipTokenizer

TOKEN_TABLE = "embeddings.token_embedding.weight"  # its state-dict name (CLIPTextModel)
POOLED_AT = ("first_eos", "largest_id")  # the manifest's text_encoders[i].pooled_at
RECOMPILE = "recompile the model with this sdiree (`sdiree compile`) to use --embedding"


@dataclass(frozen=True)
class EncodedText:
    ids: np.ndarray  # int64 [L]; ids from the vocabulary's size on are embedding vectors
    embeds: np.ndarray | None  # [L, D] in the table's dtype; None without a table
    eos_index: int  # where the end-of-text token is (what the pooled output pools)
    num_truncated: int
    used: tuple[Embedding, ...]  # the embeddings the text calls, in the order given


class TextInputs:
    """Encodes prompts for one text encoder: its tokenizer, its token table, the embeddings
    given and (for `arguments`) its declared `encode` function."""

    def __init__(
        self,
        tokenizer: ClipTokenizer,
        table: np.ndarray | None,
        embeddings: Sequence[Embedding] = (),
        decl: FunctionDecl | None = None,
        part: str | None = None,
        model: str = "SD 1.x/2.x",
        pooled_at: str = "first_eos",
    ):
        """part: which vector set of an SDXL embedding this encoder takes (None: the one set of
        an SD 1.x/2.x embedding); model: the model's family label, for refusals; pooled_at:
        where the pooled output is taken, "first_eos" or "largest_id" (the manifest's
        `pooled_at`: transformers' rule for CLIP configs with eos_token_id 2, which with an
        embedding in the prompt pools at its last token, as diffusers does)."""
        self.base = tokenizer.vocab_size
        if pooled_at not in POOLED_AT:
            raise UserError(
                f"the artifact's text encoder pools at {pooled_at!r}, which this sdiree does not "
                "know; run it with the sdiree that compiled it"
            )
        self.pooled_at = pooled_at
        self.table = table
        self.embeddings = tuple(embeddings)
        self.decl = decl
        vectors = [e.vectors_for(part, model) for e in self.embeddings]
        if embeddings and table is None:
            raise UserError(f"this artifact's text encoder takes token ids only; {RECOMPILE}")
        if table is not None and (table.ndim != 2 or table.shape[0] < self.base):
            raise UserError(
                f"the text encoder's token table has shape {list(table.shape)}, fewer rows than "
                f"the tokenizer's {self.base} tokens; recompile the model"
            )
        added, ranges, next_id = [], [], self.base
        callers: dict[str, Embedding] = {}
        for e, vecs in zip(self.embeddings, vectors, strict=True):
            if vecs.shape[1] != table.shape[1]:
                which = f"{part} " if part else ""
                raise UserError(
                    f"--embedding {e.path} has {which}vectors of width {vecs.shape[1]}; this "
                    f"model's text encoder takes {table.shape[1]} (an embedding made for "
                    "another model family?)"
                )
            ids = tuple(range(next_id, next_id + vecs.shape[0]))
            next_id += len(ids)
            ranges.append((ids[0], next_id))
            for word, single_word in e.words:
                self._check_word(tokenizer, e, word, single_word, callers)
                added.append(AddedText(word, ids, single_word))
        self._ranges = ranges
        try:
            self.tokenizer = tokenizer.with_added(added) if added else tokenizer
        except ValueError as err:
            raise UserError(f"--embedding: {err}; give it another token with FILE:TOKEN") from None
        if table is not None and self.embeddings:
            self.extra = np.concatenate(vectors).astype(table.dtype)
        else:
            self.extra = None

    @staticmethod
    def _check_word(tokenizer, e: Embedding, word: str, single_word: bool, callers: dict):
        key = word.lower()
        other = callers.get(key)
        if other is not None and other is not e:
            raise UserError(
                f"--embedding {e.path} and {other.path} both answer to {word!r}; name one of "
                "them with FILE:TOKEN"
            )
        callers[key] = e
        # diffusers refuses a token already in the vocabulary; a file's stem as a whole word
        # replaces that word, as in AUTOMATIC1111.
        if not single_word and tokenizer.in_vocabulary(word):
            example = "" if word.startswith("<") else f" (for example <{word}>)"
            raise UserError(
                f"--embedding {e.path}: {word!r} is already a token of this model's tokenizer; "
                f"choose another with {e.path}:TOKEN{example}"
            )

    @classmethod
    def for_artifact(
        cls,
        manifest: Manifest,
        embeddings: Sequence[Embedding] = (),
        *,
        replaced: Mapping[str, np.ndarray] | None = None,
        encoder: int = 0,
    ) -> TextInputs:
        """The inputs of the artifact's text encoder number `encoder`. `replaced`: tensors
        loaded in place of its archive's ({key: array}, `--weights`), the token table among
        them."""
        te = manifest.data["text_encoders"][encoder]
        part, model = embedding_part(manifest, encoder)
        tokenizer = ClipTokenizer.from_dir(manifest.path(te["tokenizer"]))
        submodule = te.get("submodule", "text_encoder")
        decl = manifest.submodules[submodule].functions["encode"]
        names = [t.name for t in decl.inputs]
        if "inputs_embeds" in names:
            width = decl.inputs[names.index("inputs_embeds")].shape[-1]
            table = token_table(manifest, submodule, width, replaced or {})
        else:
            table = None
        pooled_at = te.get("pooled_at", "first_eos")
        return cls(tokenizer, table, embeddings, decl, part=part, model=model, pooled_at=pooled_at)

    def encode(self, text: str) -> EncodedText:
        tok = self.tokenizer.encode(text)
        ids = tok.ids
        eos = np.flatnonzero(ids == self.tokenizer.eos_id)
        eos_index = int(eos[0]) if eos.size else len(ids) - 1
        if self.pooled_at == "largest_id":
            eos_index = int(np.argmax(ids))  # the first of the largest (the end token without TI)
        new = ids >= self.base
        used = tuple(
            e
            for e, (lo, hi) in zip(self.embeddings, self._ranges, strict=True)
            if ((ids >= lo) & (ids < hi)).any()
        )
        embeds = None
        if self.table is not None:
            embeds = np.empty((len(ids), self.table.shape[1]), dtype=self.table.dtype)
            embeds[~new] = self.table[ids[~new]]
            if new.any():
                embeds[new] = self.extra[ids[new] - self.base]
        return EncodedText(ids, embeds, eos_index, tok.num_truncated, used)

    def arguments(self, encoded: EncodedText, decl: FunctionDecl | None = None) -> list[np.ndarray]:
        """The arguments of `decl` (the artifact's `encode`), the encoded text in every row of
        the batch."""
        decl = decl or self.decl
        values = {
            "input_ids": encoded.ids,
            "inputs_embeds": encoded.embeds,
            "eos_index": np.asarray(encoded.eos_index, dtype=np.int64),
        }
        args = []
        for t in decl.inputs:
            value = values.get(t.name)
            if value is None:
                raise UserError(
                    f"the artifact's text encoder takes an input '{t.name}' this sdiree does "
                    "not know; run it with the sdiree that compiled it, or recompile"
                )
            if tuple(t.shape[1:]) != value.shape:
                raise UserError(
                    f"the artifact's text encoder takes '{t.name}' of shape {list(t.shape)}, "
                    f"not {list(value.shape)} per prompt; recompile the model"
                )
            row = value.astype(t.dtype, copy=False)
            args.append(np.ascontiguousarray(np.broadcast_to(row, t.shape)))
        return args


def embedding_part(manifest: Manifest, encoder: int) -> tuple[str | None, str]:
    """(the vector set of an SDXL embedding that text encoder `encoder` takes, or None for the
    one set of an SD 1.x/2.x embedding; the family's label), from the family registry."""
    from .families import load_families

    family = load_families().families.get(manifest.family)
    if family is None:
        return None, manifest.family
    recipes = family.text_encoders
    part = recipes[encoder].get("embedding") if encoder < len(recipes) else None
    return part, family.label


def token_table(
    manifest: Manifest, submodule: str, width: int, replaced: Mapping[str, np.ndarray]
) -> np.ndarray:
    """The token-embedding table [V, width] of a text encoder: a read-only view of its
    parameter archive, or the replacement for it in `replaced`."""
    from .weights.archive import Archive

    sub = manifest.submodules[submodule]
    archive = Archive(manifest.path(sub.parameters))
    keys = [k for k in archive.entries if k == TOKEN_TABLE or k.endswith("." + TOKEN_TABLE)]
    if len(keys) != 1:
        raise UserError(
            f"{sub.parameters} holds {len(keys)} token-embedding tables ({TOKEN_TABLE}), not one; "
            "recompile the model"
        )
    table = replaced[keys[0]] if keys[0] in replaced else archive.array(keys[0])
    if table.ndim != 2 or table.shape[1] != width:
        raise UserError(
            f"{sub.parameters}: the token table {keys[0]} has shape {list(table.shape)}, not "
            f"[tokens, {width}]; recompile the model"
        )
    return table
