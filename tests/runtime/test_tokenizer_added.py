"""Texts added to the tokenizer after loading (textual-inversion tokens) against transformers'
``CLIPTokenizer.add_tokens`` as diffusers' ``load_textual_inversion`` calls it, including the
multi-vector expansion diffusers' ``maybe_convert_prompt`` makes; and the whole-word matching
sdiree gives a file's stem."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sdiree.runtime.tokenizer import AddedText, ClipTokenizer

transformers = pytest.importorskip("transformers")

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "tiny_tokenizer.py"
_spec = importlib.util.spec_from_file_location("tiny_tokenizer", _TOOL)
tiny_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny_tokenizer)

# token -> number of vectors (diffusers adds <t>, <t>_1, ... for one of several vectors)
TOKENS = {"<cat-toy>": 1, "<cat>": 3, "style of van": 2, "zq": 1}
PROMPTS = [
    "a photo of <cat-toy>",
    "A PHOTO OF <CAT-TOY> on a table",
    "<cat-toy><cat-toy>x<cat-toy>",
    "a <cat> and a <cat-toy>, <cat>!",
    "painting in the style  of van gogh",
    "painting in the Style\tOf Van gogh",
    "zq zqzq azqb zq.",
    "<|endoftext|> <cat> <|startoftext|>",
    "no added tokens here at all",
    "<cat> " * 40,  # truncated in the middle of an expansion
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    tiny_tokenizer.write_tiny_clip_tokenizer(out)
    return out


def diffusers_tokenizer(tok_dir):
    ref = transformers.CLIPTokenizer.from_pretrained(tok_dir)
    for token, n in TOKENS.items():
        for name in [token] + [f"{token}_{i}" for i in range(1, n)]:
            assert ref.add_tokens(name) == 1
    return ref


def diffusers_prompt(ref, prompt: str) -> str:
    """diffusers' TextualInversionLoaderMixin._maybe_convert_prompt, restated."""
    for token in set(ref.tokenize(prompt)):
        if token in ref.added_tokens_encoder:
            replacement, i = token, 1
            while f"{token}_{i}" in ref.added_tokens_encoder:
                replacement += f" {token}_{i}"
                i += 1
            prompt = prompt.replace(token, replacement)
    return prompt


def ours_with_tokens(tok_dir) -> ClipTokenizer:
    base = ClipTokenizer.from_dir(tok_dir)
    texts, next_id = [], base.vocab_size
    for token, n in TOKENS.items():
        texts.append(AddedText(token, tuple(range(next_id, next_id + n))))
        next_id += n
    return base.with_added(texts)


def expanded_ids(ref, prompt: str) -> tuple[list[int], int]:
    """transformers' ids with each multi-vector token followed by its _1, _2... tokens, padded
    as diffusers pads, and the untruncated length."""
    ids = []
    for i in ref(prompt, add_special_tokens=False).input_ids:
        ids.append(i)
        token, k = ref.convert_ids_to_tokens(i), 1
        while f"{token}_{k}" in ref.added_tokens_encoder:
            ids.append(ref.added_tokens_encoder[f"{token}_{k}"])
            k += 1
    full = [ref.bos_token_id, *ids, ref.eos_token_id]
    padded = [ref.bos_token_id, *ids[:75], ref.eos_token_id]
    return padded + [ref.pad_token_id] * (77 - len(padded)), len(full)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_added_tokens_match_transformers_add_tokens(tok_dir, prompt):
    ref = diffusers_tokenizer(tok_dir)
    ours = ours_with_tokens(tok_dir)
    want, full_len = expanded_ids(ref, prompt)
    got = ours.encode(prompt)
    assert got.ids.tolist() == want
    assert got.num_truncated == max(0, full_len - 77)
    # diffusers expands a token by replacing its text in the prompt: where the prompt writes
    # it as the tokenizer normalises it (lowercase, single spaces), that is the same.
    normalized = " ".join(prompt.lower().split())
    if all(t in prompt for t in TOKENS if t in normalized):
        converted = diffusers_prompt(ref, prompt)
        assert (
            ref(converted, padding="max_length", max_length=77, truncation=True).input_ids == want
        )


def test_prompts_without_added_tokens_are_unchanged(tok_dir):
    base = ClipTokenizer.from_dir(tok_dir)
    ours = ours_with_tokens(tok_dir)
    for prompt in ("a photo of a cat", "cat toy <cat toy>", "x" * 200):
        assert ours.encode(prompt).ids.tolist() == base.encode(prompt).ids.tolist()


def test_single_word_text_stands_alone(tok_dir):
    base = ClipTokenizer.from_dir(tok_dir)
    v = base.vocab_size
    ours = base.with_added([AddedText("my-cat", (v, v + 1), single_word=True)])

    def calls(prompt):
        return ours.tokenize(prompt).count(v)

    assert calls("a my-cat photo") == 1
    assert calls("(my-cat:1.2), My-Cat.") == 2
    assert calls("my-cats xmy-cat my-cat_2 my-cat9") == 0
    assert ours.tokenize("my-cat")[:2] == [v, v + 1]
    assert ours.tokenize("my-cats") == base.tokenize("my-cats")


def test_added_texts_are_checked(tok_dir):
    base = ClipTokenizer.from_dir(tok_dir)
    v = base.vocab_size
    with pytest.raises(ValueError, match="same as"):
        base.with_added([AddedText("<A>", (v,)), AddedText("<a>", (v + 1,))])
    with pytest.raises(ValueError, match="same as"):
        base.with_added([AddedText("<|endoftext|>", (v,))])
    with pytest.raises(ValueError, match="past the vocabulary"):
        base.with_added([AddedText("<x>", (v - 1,))])
    with pytest.raises(ValueError, match="empty"):
        base.with_added([AddedText("", (v,))])
    assert base.in_vocabulary("a</w>") and not base.in_vocabulary("<x>")


def test_legacy_mode_matches_the_raw_text(tok_dir):
    """transformers 4.x's Python tokenizer matched added tokens in the raw text, as written."""
    base = ClipTokenizer.from_dir(tok_dir, legacy=True)
    v = base.vocab_size
    ours = base.with_added([AddedText("<Cat-Toy>", (v,))])
    assert ours.tokenize("a <Cat-Toy>") == [*base.tokenize("a"), v]
    assert v not in ours.tokenize("a <cat-toy>")
