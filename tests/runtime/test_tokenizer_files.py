"""runtime/tokenizer_files.py: which files a tokenizer folder is read from, its special tokens
and their flags, and what a bad folder says. (What the ids come to is tests/runtime/
test_tokenizer.py's, against transformers.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdiree.runtime.errors import UserError
from sdiree.runtime.tokenizer_files import DEFAULT_MAX_LENGTH, read_tokenizer_folder

VOCAB = {"<|startoftext|>": 0, "<|endoftext|>": 1, "a": 2, "b": 3, "ab</w>": 4, "b</w>": 5}


def _vocab_files(path: Path, merges: str = "#version: 0.2\na b</w>\n") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps(VOCAB), encoding="utf-8")
    (path / "merges.txt").write_text(merges, encoding="utf-8")
    return path


def _tokenizer_json(path: Path, vocab: dict) -> None:
    data = {
        "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"], "end_of_word_suffix": "</w>"},
        "added_tokens": [{"id": 9, "content": "<x>", "normalized": True}],
    }
    (path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")


def test_vocab_files_and_special_token_flags(tmp_path):
    path = _vocab_files(tmp_path / "t")
    config = {
        "model_max_length": 16,
        "pad_token": {"content": "!", "normalized": True},
        "additional_special_tokens": ["<extra>"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (path / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<|endoftext|>"}))
    files = read_tokenizer_folder(path, legacy=False)
    assert files.merges == [("a", "b</w>")]  # the #version line dropped
    assert files.bos_token == "<|startoftext|>" and files.eos_token == "<|endoftext|>"
    assert files.pad_token == "!"
    assert files.max_length == 16
    # a plain string is matched in the raw text, a dict keeps its flag; the last text wins
    assert files.added == [("<|endoftext|>", False), ("!", True), ("<extra>", False)]


def test_tokenizer_json_wins_unless_legacy(tmp_path):
    path = _vocab_files(tmp_path / "t")
    _tokenizer_json(path, {**VOCAB, "c": 6})
    assert "c" in read_tokenizer_folder(path, legacy=False).vocab
    assert read_tokenizer_folder(path, legacy=False).added == [("<x>", True)]
    legacy = read_tokenizer_folder(path, legacy=True)
    assert "c" not in legacy.vocab
    assert legacy.merges == [("a", "b</w>")]  # 4.x drops the first line whatever it is


@pytest.mark.parametrize("length", [None, 1, 10**9, "77"])
def test_unusable_model_max_length_falls_back_to_clips(tmp_path, length):
    path = _vocab_files(tmp_path / "t")
    cfg = {} if length is None else {"model_max_length": length}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    assert read_tokenizer_folder(path, legacy=False).max_length == DEFAULT_MAX_LENGTH


def test_bad_folders_name_the_file(tmp_path):
    with pytest.raises(UserError, match="neither tokenizer.json nor vocab.json"):
        read_tokenizer_folder(tmp_path, legacy=False)
    path = _vocab_files(tmp_path / "m", merges="a b c\n")
    with pytest.raises(UserError, match=r"malformed merge 'a b c' in .*merges.txt"):
        read_tokenizer_folder(path, legacy=False)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(UserError, match=r"cannot read .*tokenizer.json"):
        read_tokenizer_folder(tmp_path / "j", legacy=False)
    (tmp_path / "j" / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece"}}))
    with pytest.raises(UserError, match="is not a CLIP BPE model"):
        read_tokenizer_folder(tmp_path / "j", legacy=False)
