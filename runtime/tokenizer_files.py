"""A CLIP tokenizer folder as diffusers saves it, read for runtime/tokenizer.py: the vocabulary
and merges (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``), the special tokens
(``tokenizer_config.json``, ``special_tokens_map.json``) and the added tokens with their
``normalized`` flags, as transformers reads them (>= 5; ``legacy``: 4.x's pure-Python
CLIPTokenizer). A missing or malformed file is a UserError naming it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

EOW = "</w>"
DEFAULT_MAX_LENGTH = 77  # CLIP's text position embeddings
_LEGACY_MAX_MERGES = 49152 - 256 - 2  # transformers 4.x reads at most this many merges

# Order in which transformers registers the named special tokens; a later definition of the
# same text replaces an earlier one (and with it the ``normalized`` flag).
_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class TokenizerFiles:
    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    added: list[tuple[str, bool]]  # (text, normalized), in registration order
    bos_token: str
    eos_token: str
    pad_token: str
    unk_token: str
    max_length: int


def read_tokenizer_folder(path: Path, legacy: bool) -> TokenizerFiles:
    """Read a tokenizer folder (SD 1.x/2.x ``tokenizer/``, SDXL's ``tokenizer_2/``).

    ``tokenizer.json`` wins over ``vocab.json`` + ``merges.txt`` when both are present, as
    in transformers >= 5; ``legacy=True`` reads the latter, as transformers 4.x did.
    """
    config = _read_json(path / "tokenizer_config.json") or {}
    special = _read_json(path / "special_tokens_map.json") or {}

    definitions: dict[str, tuple[str, bool]] = {}
    for source in (config, special):
        for key in _SPECIAL_KEYS:
            if key in source and source[key] is not None:
                definitions[key] = _token_definition(source[key])

    tokenizer_json = None
    if not (legacy and (path / "vocab.json").is_file()):
        tokenizer_json = _read_json(path / "tokenizer.json")
    if tokenizer_json is not None:
        vocab, merges, added = _from_tokenizer_json(tokenizer_json, path)
    else:
        vocab, merges = _from_vocab_files(path, legacy)
        # No stored flags: a token given as a plain string is matched in the raw text, one
        # given as an AddedToken dict keeps its own flag; the last definition of a text wins.
        by_text: dict[str, bool] = {}
        for key in _SPECIAL_KEYS:
            if key in definitions:
                content, normalized = definitions[key]
                by_text.pop(content, None)
                by_text[content] = normalized
        for extra in config.get("additional_special_tokens") or []:
            content, normalized = _token_definition(extra)
            by_text.pop(content, None)
            by_text[content] = normalized
        added = list(by_text.items())

    def name(key: str, default: str | None) -> str | None:
        return definitions[key][0] if key in definitions else default

    max_length = config.get("model_max_length")
    if not isinstance(max_length, int) or not 2 <= max_length <= 1_000_000:
        max_length = DEFAULT_MAX_LENGTH
    return TokenizerFiles(
        vocab,
        merges,
        added,
        bos_token=name("bos_token", "<|startoftext|>"),
        eos_token=name("eos_token", "<|endoftext|>"),
        pad_token=name("pad_token", None) or name("eos_token", "<|endoftext|>"),
        unk_token=name("unk_token", "<|endoftext|>"),
        max_length=max_length,
    )


def _read_json(path: Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"tokenizer: cannot read {path}: {e}") from None


def _token_definition(value) -> tuple[str, bool]:
    """(text, normalized) of a special-token entry: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value["content"]), bool(value.get("normalized", False))
    return str(value), False


def _from_vocab_files(path: Path, legacy: bool) -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab_file, merges_file = path / "vocab.json", path / "merges.txt"
    if not vocab_file.is_file() or not merges_file.is_file():
        raise UserError(f"tokenizer: {path} has neither tokenizer.json nor vocab.json + merges.txt")
    vocab = _read_json(vocab_file)
    text = merges_file.read_text(encoding="utf-8")
    if legacy:
        # transformers 4.x: drop the first line whatever it is, keep at most 48894 merges.
        lines = text.strip().split("\n")[1 : _LEGACY_MAX_MERGES + 1]
    else:
        lines = [ln for ln in text.split("\n") if ln.strip() and not ln.startswith("#version")]
    merges = []
    for line in lines:
        parts = line.split()
        if len(parts) != 2:
            raise UserError(f"tokenizer: malformed merge {line!r} in {merges_file}")
        merges.append((parts[0], parts[1]))
    return vocab, merges


def _from_tokenizer_json(
    data: dict, path: Path
) -> tuple[dict[str, int], list[tuple[str, str]], list[tuple[str, bool]]]:
    model = data.get("model") or {}
    if model.get("type") != "BPE" or model.get("end_of_word_suffix", EOW) != EOW:
        raise UserError(f"tokenizer: {path}/tokenizer.json is not a CLIP BPE model")
    merges = []
    for merge in model.get("merges") or []:
        parts = merge.split(" ") if isinstance(merge, str) else list(merge)
        if len(parts) != 2:
            raise UserError(f"tokenizer: malformed merge {merge!r} in {path}/tokenizer.json")
        merges.append((parts[0], parts[1]))
    vocab = dict(model.get("vocab") or {})
    added = []
    for token in data.get("added_tokens") or []:
        vocab.setdefault(token["content"], token["id"])
        added.append((token["content"], bool(token.get("normalized", False))))
    return vocab, merges, added
