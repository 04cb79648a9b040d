"""sdiree.runtime.tokenizer against transformers.CLIPTokenizer, on tokenizers from tools/tiny_tokenizer.

With transformers >= 5, ``CLIPTokenizer`` (what diffusers loads) and ``CLIPTokenizerFast`` are
one class built on the tokenizers library; the default mode must give its ids exactly.
``legacy=True`` is checked against ids recorded from transformers 4.57.1's pure-Python
``CLIPTokenizer`` (no ftfy) on the seed-0 tiny tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdiree.runtime.errors import UserError
from sdiree.runtime.tokenizer import ClipTokenizer, TokenizedText

transformers = pytest.importorskip("transformers")

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "tiny_tokenizer.py"
_spec = importlib.util.spec_from_file_location("tiny_tokenizer", _TOOL)
tiny_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny_tokenizer)

LONG = "a highly detailed photo of a red fox in the snowy forest at dawn, " * 8

PROMPTS = [
    "",
    " ",
    " \t\n ",
    "a photo of a cat",
    "A Photo OF a CAT",
    "  leading and trailing spaces   ",
    "hello, world!!! (masterpiece:1.2) [x]",
    "((best quality)), {detailed}, <lora:x:0.5>, a_b-c/d\\e|f~g^h",
    "digits 0123456789 3.14159 1,000,000 2024-01-01",
    "don't it's we're they've I'm you'll he'd 'quoted' ''s",
    "DON'T IT'S",
    "café naïve résumé façade Ångström crème brûlée",
    "e\u0301 a\u0308 n\u0303 \u0301 (decomposed accents)",
    "東京 北京 日本語 中文 한국어 カタカナ",
    "😀 🎨🔥 emoji 👩‍👩‍👧 flags 🇯🇵",
    "Ελληνικά ΟΔΥΣΣΕΥΣ Русский текст",
    "İstanbul ß ẞ ǅ Ω K ﬁ ² ٣ Ⅳ",
    "tabs\tand\nnewlines\r\nand\x0bvertical\x0cfeeds",
    "control\x00chars\x01here\x1f\x7f and\u200bzero\ufeffwidth\ufffd",
    "nbsp\u00a0ideographic\u3000line\u2028para\u2029next\u0085",
    "<|endoftext|> inside <|startoftext|> text",
    "<|ENDOFTEXT|> <|StartOfText|> <|endoftext",
    "words notinmerges qwxz zzyzx pneumonoultramicroscopic",
    "supercalifragilisticexpialidocious" * 5,
    "a" * 300,
    LONG,
    "!!! ??? ... --- *** ### $$$ %%% &&& @@@",
    "x" + "!" * 100,
]


def write(path: Path, **kwargs) -> Path:
    tiny_tokenizer.write_tiny_clip_tokenizer(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def bang_pad_dir(tmp_path_factory) -> Path:
    # SD 2.x pads with "!", which then becomes a special token of its own.
    return write(tmp_path_factory.mktemp("tok_bang"), pad_token="!", num_merges=200, seed=3)


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory, tiny_dir) -> Path:
    # What a diffusers pipeline's save_pretrained writes with transformers 5: tokenizer.json.
    out = tmp_path_factory.mktemp("tok_saved")
    transformers.CLIPTokenizer.from_pretrained(tiny_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sd_size_dir(tmp_path_factory) -> Path:
    """A 49408-entry vocabulary with SD 1.5's special-token ids (49406, 49407) and a short
    max length, so no code can lean on small ids or on 77."""
    out = write(tmp_path_factory.mktemp("tok_big"), num_merges=400, model_max_length=32)
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    specials = [tiny_tokenizer.BOS, tiny_tokenizer.EOS]
    base = [t for t in sorted(vocab, key=vocab.get) if t not in specials]
    fillers = [f"<unused{i}>" for i in range(49408 - len(base) - 2)]
    big = {t: i for i, t in enumerate(base + fillers + specials)}
    (out / "vocab.json").write_text(json.dumps(big, ensure_ascii=False), encoding="utf-8")
    return out


def reference(tok, text: str) -> tuple[list[int], int]:
    """diffusers' call, and the untruncated length it compares against."""
    ids = tok(text, padding="max_length", max_length=tok.model_max_length, truncation=True)
    return ids.input_ids, len(tok(text).input_ids)


def assert_matches(ours: ClipTokenizer, ref, text: str) -> None:
    want, full_len = reference(ref, text)
    got = ours.encode(text)
    assert got.ids.tolist() == want, repr(text)
    assert got.num_truncated == max(0, full_len - ref.model_max_length), repr(text)


# ------------------------------------------------------------------------------- tiny_tokenizer


def test_tiny_tokenizer_layout(tiny_dir):
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == ["merges.txt", "special_tokens_map.json", "tokenizer_config.json", "vocab.json"]
    vocab = json.loads((tiny_dir / "vocab.json").read_text(encoding="utf-8"))
    merges = (tiny_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2"
    assert len(merges) - 1 == 300
    assert len(vocab) == 512 + 300 + 2
    by_id = sorted(vocab, key=vocab.get)
    assert by_id[0] == "!" and by_id[255] == "Ń" and by_id[256] == "!</w>"
    assert by_id[-2:] == ["<|startoftext|>", "<|endoftext|>"]
    assert sorted(vocab.values()) == list(range(len(vocab)))
    first_merged = by_id[512]
    assert first_merged == "".join(merges[1].split())
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["model_max_length"] == 77 and config["tokenizer_class"] == "CLIPTokenizer"


def test_tiny_tokenizer_is_deterministic_and_seeded(tmp_path):
    a = write(tmp_path / "a", seed=5)
    b = write(tmp_path / "b", seed=5)
    c = write(tmp_path / "c", seed=6)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "merges.txt").read_bytes() != (c / "merges.txt").read_bytes()


def test_tiny_tokenizer_loads_and_merges_common_words(tiny_dir):
    for cls in (transformers.CLIPTokenizer, transformers.CLIPTokenizerFast):
        tok = cls.from_pretrained(tiny_dir)
        assert len(tok) == 814
        assert tok.model_max_length == 77
        assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 813
        assert tok.bos_token_id == 812 and tok.eos_token_id == 813
        assert tok.convert_ids_to_tokens(tok("a photo of a cat").input_ids) == [
            "<|startoftext|>",
            "a</w>",
            "photo</w>",
            "of</w>",
            "a</w>",
            "cat</w>",
            "<|endoftext|>",
        ]


def test_tiny_tokenizer_runs_out_of_pairs_gracefully(tmp_path):
    out = write(tmp_path / "all", num_merges=100_000)
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    n_merges = len((out / "merges.txt").read_text(encoding="utf-8").splitlines()) - 1
    assert 300 < n_merges < 100_000
    assert len(vocab) == 512 + n_merges + 2
    ours, ref = ClipTokenizer.from_dir(out), transformers.CLIPTokenizer.from_pretrained(out)
    for text in PROMPTS:
        assert_matches(ours, ref, text)


def test_tiny_tokenizer_cli(tmp_path):
    subprocess.run(
        [sys.executable, str(_TOOL), str(tmp_path / "cli"), "--seed", "2", "--num-merges", "50"],
        check=True,
        capture_output=True,
    )
    vocab = json.loads((tmp_path / "cli" / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 512 + 50 + 2


# ------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("text", PROMPTS)
def test_matches_transformers(tiny_dir, text):
    assert_matches(
        ClipTokenizer.from_dir(tiny_dir), transformers.CLIPTokenizer.from_pretrained(tiny_dir), text
    )


@pytest.mark.parametrize("which", ["bang_pad_dir", "saved_dir", "sd_size_dir"])
def test_matches_transformers_on_other_folders(request, which):
    path = request.getfixturevalue(which)
    ours, ref = ClipTokenizer.from_dir(path), transformers.CLIPTokenizer.from_pretrained(path)
    assert ours.max_length == ref.model_max_length
    assert ours.pad_id == ref.pad_token_id
    for text in PROMPTS:
        assert_matches(ours, ref, text)


def random_prompts(n: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    ascii_chars = [chr(c) for c in range(32, 127)]
    # Characters assigned long ago, so Python's and the tokenizers library's Unicode tables agree.
    other = list(
        "éèêëüöäñçßøåæœÆØÅÉÑ東京日本語中文字한국어カタナひらがΣΑΩαβγδσςЖжЯяİıẞǅ😀🎨🔥👍"
        "\t\n\r\x0b\x0c\x1c\x1f\x00\x01\x7f\x85\xa0\u2028\u2029\u3000\u200b\u200d\ufeff\ufffd"
        "\u0301\u0308\u0345\u202e\u2126\u212a\u00b2\u0663\u2163\ufb01"
    )
    words = ["photo", "cat", "the", "a", "of", "painting", "<|endoftext|>", "<|startoftext|>"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 12)):
            r = rng.random()
            if r < 0.3:
                parts.append(rng.choice(words))
            elif r < 0.6:
                parts.append("".join(rng.choices(ascii_chars, k=rng.randint(1, 8))))
            else:
                parts.append("".join(rng.choices(other + ascii_chars, k=rng.randint(1, 6))))
            parts.append(rng.choice([" ", " ", "", ", ", "\n"]))
        out.append("".join(parts))
    return out


def test_random_fuzz_matches_transformers(tiny_dir, bang_pad_dir):
    for path in (tiny_dir, bang_pad_dir):
        ours, ref = ClipTokenizer.from_dir(path), transformers.CLIPTokenizer.from_pretrained(path)
        for text in random_prompts(200):
            assert_matches(ours, ref, text)


def test_fast_tokenizer_agrees(tiny_dir):
    """CLIPTokenizerFast is not what diffusers uses; record whether it agrees all the same."""
    fast = transformers.CLIPTokenizerFast.from_pretrained(tiny_dir)
    ours = ClipTokenizer.from_dir(tiny_dir)
    differing = [
        t
        for t in PROMPTS + random_prompts(50)
        if reference(fast, t)[0] != ours.encode(t).ids.tolist()
    ]
    if transformers.CLIPTokenizerFast is transformers.CLIPTokenizer:
        assert differing == []
    elif differing:
        pytest.xfail(
            f"CLIPTokenizerFast differs on {len(differing)} prompts, e.g. {differing[0]!r}"
        )


# ---------------------------------------------------------------------- truncation and padding


def test_truncation_keeps_eos_last_and_counts_dropped(tiny_dir):
    ours, ref = (
        ClipTokenizer.from_dir(tiny_dir),
        transformers.CLIPTokenizer.from_pretrained(tiny_dir),
    )
    n_content = len(ours.tokenize(LONG))
    assert n_content > 75
    enc = ours.encode(LONG)
    assert enc.ids.shape == (77,)
    assert enc.ids[0] == ours.bos_id and enc.ids[-1] == ours.eos_id
    assert enc.num_truncated == n_content + 2 - 77 == len(ref(LONG).input_ids) - 77
    assert_matches(ours, ref, LONG)


@pytest.mark.parametrize("n_words", [74, 75, 76, 77])
def test_truncation_boundary(tiny_dir, n_words):
    # "cat" is one token, so n words are n content tokens.
    ours, ref = (
        ClipTokenizer.from_dir(tiny_dir),
        transformers.CLIPTokenizer.from_pretrained(tiny_dir),
    )
    text = " ".join(["cat"] * n_words)
    assert len(ours.tokenize(text)) == n_words
    assert ours.encode(text).num_truncated == max(0, n_words - 75)
    assert_matches(ours, ref, text)


def test_encoding_shape_dtype_and_padding(tiny_dir):
    tok = ClipTokenizer.from_dir(tiny_dir)
    enc = tok.encode("a photo of a cat")
    assert isinstance(enc, TokenizedText)
    assert enc.ids.dtype == np.int64 and enc.ids.shape == (tok.max_length,) == (77,)
    assert enc.num_truncated == 0
    assert tok.pad_id == 813
    assert enc.ids.tolist()[:7] == [812, 320, 605, 530, 320, 780, 813]
    assert set(enc.ids.tolist()[7:]) == {tok.pad_id}
    empty = tok.encode("")
    assert empty.ids.tolist() == [812] + [813] * 76


def test_short_model_max_length(sd_size_dir):
    tok = ClipTokenizer.from_dir(sd_size_dir)
    assert tok.max_length == 32 and tok.vocab_size == 49408
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (49406, 49407, 49407)
    enc = tok.encode(LONG)
    assert enc.ids.shape == (32,) and enc.ids[-1] == 49407
    assert enc.num_truncated == len(tok.tokenize(LONG)) - 30


# ----------------------------------------------------------------------------------- legacy


# transformers 4.57.1 CLIPTokenizer (pure Python, no ftfy) on the seed-0 tiny tokenizer.
LEGACY_IDS = {
    "東京タワー 北京": [162, 251, 365, 160, 118, 361, 159, 224, 123, 159, 225, 107, 159, 225, 376]
    + [161, 234, 501, 160, 118, 361],
    "a\x01b\x7fc\u200bd\ufeffe\ufffdf": [64, 65, 66, 539, 325],
    "<|ENDOFTEXT|> and <|StartOfText|>": [813, 525, 812],
    "ΟΔΥΣΣΕΥΣ ΣΑΣ": [138, 123, 138, 112, 139, 227, 139, 225, 139, 225, 138, 113, 139, 227]
    + [139, 480, 139, 225, 138, 109, 139, 480],
    "line\u2028sep\u2029para": [75, 512, 324, 82, 68, 335, 79, 523, 320],
    "café naïve": [545, 69, 127, 358, 77, 64, 127, 107, 634],
    "a photo of a cat, masterpiece!!": [320, 605, 530, 320, 780, 267, 688, 524, 555, 79, 561]
    + [66, 324, 0, 256],
}


@pytest.mark.parametrize("text", list(LEGACY_IDS))
def test_legacy_mode_matches_transformers4(tiny_dir, text):
    tok = ClipTokenizer.from_dir(tiny_dir, legacy=True)
    want = LEGACY_IDS[text]
    assert tok.tokenize(text) == want
    assert tok.encode(text).ids.tolist()[: len(want) + 2] == [812, *want, 813]


def test_legacy_and_default_differ_only_on_unusual_text(tiny_dir):
    default, legacy = (
        ClipTokenizer.from_dir(tiny_dir),
        ClipTokenizer.from_dir(tiny_dir, legacy=True),
    )
    assert default.tokenize("東京") != legacy.tokenize("東京")
    for text in ["a photo of a cat", "hello, world!!! (masterpiece:1.2)", "don't it's", LONG]:
        assert default.encode(text).ids.tolist() == legacy.encode(text).ids.tolist()


# ------------------------------------------------------------------------------------ misc


def test_missing_files_raise_user_error(tmp_path):
    with pytest.raises(UserError):
        ClipTokenizer.from_dir(tmp_path)


def test_bad_merge_raises_user_error(tmp_path):
    out = write(tmp_path / "t", num_merges=10)
    with (out / "merges.txt").open("a", encoding="utf-8") as f:
        f.write("zz qq\n")
    with pytest.raises(UserError):
        ClipTokenizer.from_dir(out)


def test_module_is_torch_and_transformers_free():
    code = (
        "import sys, sdiree.runtime.tokenizer\n"
        "bad = {'torch', 'transformers', 'tokenizers'} & set(sys.modules)\n"
        "sys.exit(sorted(bad) or 0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
