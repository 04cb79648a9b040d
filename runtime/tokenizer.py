"""Torch-free CLIP tokenizer: prompt text to the padded token ids Stable Diffusion's encoder takes.

Reads a diffusers ``tokenizer/`` folder (``vocab.json`` + ``merges.txt``, or ``tokenizer.json``,
with ``tokenizer_config.json`` / ``special_tokens_map.json``; read by tokenizer_files.py) and
reproduces what ``transformers.CLIPTokenizer`` returns for ``tokenizer(prompt,
padding="max_length", max_length=tokenizer.model_max_length, truncation=True)``. In
transformers >= 5 that class is the ``tokenizers``-library pipeline (the same one
``CLIPTokenizerFast`` is in 4.x), replayed here:

1. special ("added") tokens are cut out of the raw text first (leftmost-longest match); those
   flagged ``normalized`` are looked for again after normalisation;
2. normalisation: NFC, every whitespace run becomes one space, per-character lowercasing;
3. pre-tokenisation: keep only the matches of CLIP's pattern (whitespace is dropped), split each
   again with GPT-2's byte-level pattern, and map UTF-8 bytes to CLIP's printable characters;
4. byte-pair merges, lowest rank first (leftmost on ties), with ``</w>`` on a word's last symbol;
5. ``<|startoftext|>`` + at most ``max_length - 2`` ids + ``<|endoftext|>``, then pad.

``with_added`` gives a tokenizer that also knows texts added after loading, as
``tokenizer.add_tokens(...)`` adds them (what diffusers' ``load_textual_inversion`` does): such a
text is matched after normalisation (so case does not matter), anywhere in the prompt, longest
first, and may stand for several ids (a multi-vector embedding's ``<t> <t>_1 ...``); one marked
``single_word`` is matched only where no letter, digit or underscore touches it.

``legacy=True`` instead reproduces transformers 4.x's pure-Python ``CLIPTokenizer`` without ftfy
(what diffusers used with transformers < 5): every special token cut out of the raw text, then
BERT's BasicTokenizer clean-up (control characters dropped, other whitespace made a space,
spaces put around CJK ideographs, NFC, whitespace split, whole-word lowercasing), CLIP's pattern
without the GPT-2 re-split, and the literal ``<|startoftext|>``/``<|endoftext|>`` kept whole.
The two agree on ordinary prompts; they differ on control characters, CJK, U+2028-like
separators, a Greek final sigma and special-token look-alikes in the prompt.

Only the standard library, numpy and ``regex`` (for ``\\p{L}``-style classes) are used.
"""

from __future__ import annotations

import copy
import heapq
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import regex

from .errors import UserError
from .tokenizer_files import DEFAULT_MAX_LENGTH, EOW, read_tokenizer_folder

__all__ = ["AddedText", "ClipTokenizer", "TokenizedText"]


_CLIP_PATTERN = regex.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
)
_BYTE_LEVEL_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
_WHITESPACE = regex.compile(r"\s+")
_LEGACY_PATTERN = regex.compile(_CLIP_PATTERN.pattern, regex.IGNORECASE)
_LEGACY_WHOLE = ("<|startoftext|>", "<|endoftext|>")
# BERT's "Chinese character" blocks, which its BasicTokenizer surrounds with spaces.
_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


def _bytes_to_unicode() -> dict[int, str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_CHARS = _bytes_to_unicode()


@dataclass(frozen=True)
class TokenizedText:
    """One encoded prompt: ``ids`` is int64 of shape [max_length], already padded."""

    ids: np.ndarray
    num_truncated: int


@dataclass(frozen=True)
class AddedText:
    """A text added to the vocabulary after loading: the ids it stands for (one or more, none
    of them in the vocabulary) and whether it must stand alone as a word."""

    content: str
    ids: tuple[int, ...]
    single_word: bool = False


@dataclass(frozen=True)
class _AddedToken:
    content: str
    id: int
    normalized: bool


class ClipTokenizer:
    """CLIP byte-level BPE tokenizer with the text handling of ``transformers.CLIPTokenizer``."""

    def __init__(
        self,
        vocab: dict[str, int],
        merges: list[tuple[str, str]],
        *,
        bos_token: str = "<|startoftext|>",
        eos_token: str = "<|endoftext|>",
        pad_token: str = "<|endoftext|>",
        unk_token: str | None = "<|endoftext|>",
        model_max_length: int = DEFAULT_MAX_LENGTH,
        added_tokens: list[tuple[str, bool]] | None = None,
        legacy: bool = False,
    ) -> None:
        """``added_tokens``: (text, normalized) pairs cut out of prompts whole, by default the
        special tokens; ``normalized`` ones are looked for after normalisation (not in legacy
        mode, which looks for all of them in the raw text)."""
        self.legacy = legacy
        self._vocab = dict(vocab)
        # (left id, right id) -> (rank, merged id); a repeated pair keeps its last rank.
        self._merges: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (left, right) in enumerate(merges):
            ids = [self._vocab.get(t) for t in (left, right, left + right)]
            if None in ids:
                raise UserError(
                    f"tokenizer: merge {left!r} {right!r} uses a token not in the vocabulary"
                )
            self._merges[(ids[0], ids[1])] = (rank, ids[2])
        if model_max_length < 2:
            raise ValueError(f"model_max_length must be >= 2, got {model_max_length}")
        self._max_length = int(model_max_length)
        self.bos_id = self._require(bos_token, "bos_token")
        self.eos_id = self._require(eos_token, "eos_token")
        self._pad_id = self._require(pad_token, "pad_token")
        self.unk_id = self._vocab.get(unk_token) if unk_token is not None else None
        if added_tokens is None:
            added_tokens = [(t, False) for t in (bos_token, eos_token, unk_token, pad_token) if t]
        table: dict[str, _AddedToken] = {}
        for content, normalized in added_tokens:
            if content:
                table[content] = _AddedToken(
                    content, self._require(content, "added token"), normalized
                )
        raw = [t for t in table.values() if legacy or not t.normalized]
        self._raw_specials = [(t.content, (t.id,), False) for t in raw]
        self._normalized_specials = [
            (t.content, (t.id,), False) for t in table.values() if t not in raw
        ]
        self._raw_added = _TokenMatcher(self._raw_specials)
        self._normalized_added = _TokenMatcher(self._normalized_specials)
        self._bpe_cache: dict[str, list[int]] = {}

    def _require(self, token: str, what: str) -> int:
        if token not in self._vocab:
            raise UserError(f"tokenizer: {what} {token!r} is not in the vocabulary")
        return self._vocab[token]

    @classmethod
    def from_dir(cls, path: str | Path, *, legacy: bool = False) -> ClipTokenizer:
        """Load a tokenizer folder as diffusers saves it (tokenizer_files.read_tokenizer_folder
        says which files win; ``legacy=True`` reads them as transformers 4.x did)."""
        path = Path(path)
        files = read_tokenizer_folder(path, legacy)
        try:
            return cls(
                files.vocab,
                files.merges,
                bos_token=files.bos_token,
                eos_token=files.eos_token,
                pad_token=files.pad_token,
                unk_token=files.unk_token,
                model_max_length=files.max_length,
                added_tokens=files.added,
                legacy=legacy,
            )
        except UserError as e:
            raise UserError(f"{e} (in {path})") from None

    def with_added(self, texts: list[AddedText]) -> ClipTokenizer:
        """A copy of this tokenizer that also cuts ``texts`` out of prompts, as transformers'
        ``add_tokens`` does (in legacy mode: matched in the raw text, case and all, as 4.x's
        Python tokenizer did). ValueError for a text that is empty, repeats another or a special
        token, or has an id inside the vocabulary."""
        added = copy.copy(self)
        seen = {
            c if self.legacy else _normalize(c): c
            for c, _, _ in self._raw_specials + self._normalized_specials
        }
        new = []
        for t in texts:
            content = t.content if self.legacy else _normalize(t.content)
            if not content:
                raise ValueError(f"added text {t.content!r} is empty")
            if content in seen:
                raise ValueError(f"added text {t.content!r} is the same as {seen[content]!r}")
            if not t.ids or any(i < self.vocab_size for i in t.ids):
                raise ValueError(f"added text {t.content!r}: ids {t.ids} not past the vocabulary")
            seen[content] = t.content
            new.append((content, tuple(t.ids), t.single_word))
        if self.legacy:
            added._raw_specials = self._raw_specials + new
            added._raw_added = _TokenMatcher(added._raw_specials)
        else:
            added._normalized_specials = self._normalized_specials + new
            added._normalized_added = _TokenMatcher(added._normalized_specials)
        return added

    def in_vocabulary(self, text: str) -> bool:
        """Whether text is an entry of the vocabulary (as ``text in tokenizer.get_vocab()``)."""
        return text in self._vocab

    @property
    def max_length(self) -> int:
        """Padded length of every encoding (the config's ``model_max_length``, 77 for SD)."""
        return self._max_length

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def encode(self, text: str) -> TokenizedText:
        """Ids as ``tokenizer(text, padding="max_length", truncation=True)`` gives them."""
        content = self.tokenize(text)
        room = self._max_length - 2
        num_truncated = max(0, len(content) - room)
        ids = [self.bos_id, *content[:room], self.eos_id]
        ids += [self._pad_id] * (self._max_length - len(ids))
        return TokenizedText(ids=np.asarray(ids, dtype=np.int64), num_truncated=num_truncated)

    def tokenize(self, text: str) -> list[int]:
        """The ids of text alone: no start/end tokens, no truncation, no padding."""
        ids: list[int] = []
        for segment, token in self._raw_added.split(text):
            if token is not None:
                ids.extend(token)
            elif self.legacy:
                for word in _LEGACY_PATTERN.findall(_legacy_normalize(segment)):
                    if word in _LEGACY_WHOLE:  # pre-seeded in transformers' BPE cache
                        ids.append(self._vocab.get(word, self.unk_id))
                    else:
                        ids.extend(self._bpe(word))
            else:
                ids.extend(self._tokenize_segment(segment))
        return [i for i in ids if i is not None]

    def _tokenize_segment(self, segment: str) -> list[int]:
        ids: list[int] = []
        for piece, token in self._normalized_added.split(_normalize(segment)):
            if token is not None:
                ids.extend(token)
                continue
            for word in _CLIP_PATTERN.findall(piece):
                # Only changes anything for a literal "<|endoftext|>"-like piece.
                for sub in _BYTE_LEVEL_PATTERN.findall(word):
                    ids.extend(self._bpe(sub))
        return ids

    def _bpe(self, word: str) -> list[int]:
        cached = self._bpe_cache.get(word)
        if cached is not None:
            return cached
        chars = [_BYTE_CHARS[b] for b in word.encode("utf-8")]
        chars[-1] += EOW
        ids = [self._vocab.get(c, self.unk_id) for c in chars]
        ids = self._merge(ids)
        if len(self._bpe_cache) < 100_000:
            self._bpe_cache[word] = ids
        return ids

    def _merge(self, ids: list[int | None]) -> list[int]:
        # The tokenizers library's merge loop: a heap of (rank, position) over a linked list of
        # symbols; the lowest rank goes first, the leftmost on ties, and an entry whose pair
        # has changed since it was queued is skipped.
        merges = self._merges
        n = len(ids)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []
        for i in range(n - 1):
            m = merges.get((ids[i], ids[i + 1]))
            if m is not None:
                heap.append((m[0], i, m[1]))
        heapq.heapify(heap)
        while heap:
            _, pos, new_id = heapq.heappop(heap)
            right = nxt[pos]
            if not alive[pos] or right >= n:
                continue
            m = merges.get((ids[pos], ids[right]))
            if m is None or m[1] != new_id:
                continue
            ids[pos] = new_id
            alive[right] = False
            nxt[pos] = nxt[right]
            if nxt[pos] < n:
                prv[nxt[pos]] = pos
            if prv[pos] >= 0:
                m = merges.get((ids[prv[pos]], new_id))
                if m is not None:
                    heapq.heappush(heap, (m[0], prv[pos], m[1]))
            if nxt[pos] < n:
                m = merges.get((new_id, ids[nxt[pos]]))
                if m is not None:
                    heapq.heappush(heap, (m[0], pos, m[1]))
        return [i for i, a in zip(ids, alive, strict=True) if a]


def _normalize(text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    text = _WHITESPACE.sub(" ", text)
    # Per character: no context-dependent rules such as the Greek final sigma.
    return "".join(c.lower() for c in text) if not text.isascii() else text.lower()


def _legacy_normalize(text: str) -> str:
    # transformers 4.x: BasicTokenizer(strip_accents=False, do_split_on_punc=False).tokenize,
    # joined with spaces.
    out = []
    for c in text:
        cp = ord(c)
        if c in " \t\n\r":
            out.append(" ")
            continue
        category = unicodedata.category(c)
        if cp == 0 or cp == 0xFFFD or category[0] == "C":
            continue
        if category == "Zs":
            out.append(" ")
        elif any(lo <= cp <= hi for lo, hi in _CJK_RANGES):
            out.append(f" {c} ")
        else:
            out.append(c)
    words = unicodedata.normalize("NFC", "".join(out)).split()
    return " ".join(" ".join(w.lower() for w in words).split())


class _TokenMatcher:
    """Splits text around whole added tokens, leftmost match first, longest on ties; a
    single-word token counts only where no word character touches it."""

    def __init__(self, tokens: list[tuple[str, tuple[int, ...], bool]]) -> None:
        self._ids = {content: ids for content, ids, _ in tokens}
        alone = {content for content, _, single_word in tokens if single_word}
        ordered = sorted(self._ids, key=len, reverse=True)
        alternatives = [
            rf"(?<!\w){regex.escape(c)}(?!\w)" if c in alone else regex.escape(c) for c in ordered
        ]
        self._pattern = regex.compile("|".join(alternatives)) if ordered else None

    def split(self, text: str) -> list[tuple[str, tuple[int, ...] | None]]:
        if self._pattern is None:
            return [(text, None)] if text else []
        parts: list[tuple[str, tuple[int, ...] | None]] = []
        start = 0
        for m in self._pattern.finditer(text):
            if m.start() > start:
                parts.append((text[start : m.start()], None))
            parts.append((m.group(), self._ids[m.group()]))
            start = m.end()
        if start < len(text):
            parts.append((text[start:], None))
        return parts
