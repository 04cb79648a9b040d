"""Reading textual-inversion files torch-free: AUTOMATIC1111's .pt and .safetensors, diffusers'
learned_embeds; the words that call each; A1111's short hash; one clear line for bad files."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from sdiree.runtime.embeddings import load_embedding, load_embeddings, parse_embedding_option
from sdiree.runtime.errors import UserError

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

VECTORS = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))


def a1111_pt(path, vectors=VECTORS):
    """What AUTOMATIC1111's Embedding.save writes."""
    torch.save(
        {
            "string_to_token": {"*": 265},
            "string_to_param": {"*": vectors},
            "name": "trained-name",
            "step": 1500,
            "sd_checkpoint": "abcdef12",
            "sd_checkpoint_name": "model",
        },
        path,
    )
    return path


def test_a1111_safetensors(tmp_path):
    path = tmp_path / "my-cat.safetensors"
    safetensors_torch.save_file({"emb_params": VECTORS.half()}, path)
    e = load_embedding(path)
    assert e.vectors.dtype == np.float32 and e.vectors.shape == (3, 32)
    np.testing.assert_array_equal(e.vectors, VECTORS.half().float().numpy())
    assert e.name == "my-cat"
    assert e.words == (("my-cat", True), ("<my-cat>", False))
    assert e.short_hash == hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def test_a1111_pt(tmp_path):
    e = load_embedding(a1111_pt(tmp_path / "charturner.pt"))
    np.testing.assert_array_equal(e.vectors, VECTORS.numpy())
    assert e.name == "charturner"  # A1111 names it by the file, not by its "name"


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_diffusers_learned_embeds(tmp_path, suffix):
    path = tmp_path / f"learned_embeds{suffix}"
    vector = VECTORS[0].to(torch.bfloat16)
    if suffix == ".bin":
        torch.save({"<cat-toy>": vector}, path)
    else:
        safetensors_torch.save_file({"<cat-toy>": vector}, path)
    e = load_embedding(path)
    np.testing.assert_array_equal(e.vectors, vector.float().numpy()[None])
    assert e.words == (("<cat-toy>", False),)  # the token the file names, as diffusers uses it
    assert e.name == "<cat-toy>"


def test_a_given_token_is_the_only_word(tmp_path):
    path = tmp_path / "x.safetensors"
    safetensors_torch.save_file({"<cat-toy>": VECTORS}, path)
    e = load_embedding(path, "<kitty>")
    assert e.words == (("<kitty>", False),) and e.name == "<kitty>"


def test_option_parsing(tmp_path):
    from pathlib import Path

    assert parse_embedding_option("a/b.pt") == (Path("a/b.pt"), None)
    assert parse_embedding_option("a/b.pt:<tok>") == (Path("a/b.pt"), "<tok>")
    assert parse_embedding_option("C:\\emb\\b.pt")[1] is None
    assert parse_embedding_option("b.pt:x:y")[1] == "y"
    odd = tmp_path / "a:b.pt"  # a colon in an existing file's name stays in the name
    safetensors_torch.save_file({"emb_params": VECTORS}, odd)
    assert parse_embedding_option(str(odd)) == (odd, None)
    with pytest.raises(UserError, match="empty"):
        parse_embedding_option("b.pt: ")
    assert parse_embedding_option(f"{odd}:a</w>") == (odd, "a</w>")  # the file exists


def test_several_and_repeats(tmp_path):
    one = tmp_path / "one.safetensors"
    safetensors_torch.save_file({"emb_params": VECTORS}, one)
    es = load_embeddings([str(one), f"{one}:<other>"])
    assert [e.name for e in es] == ["one", "<other>"]
    with pytest.raises(UserError, match="given twice"):
        load_embeddings([str(one), str(one)])


def bad(tmp_path, name, tensors):
    path = tmp_path / name
    safetensors_torch.save_file(tensors, path)
    return path


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"a": VECTORS, "b": VECTORS.clone()}, "2 tensors"),
        ({"clip_l": VECTORS}, "has clip_l vectors but no clip_g"),
        ({"emb_params": VECTORS.long()}, "not floating point"),
        ({"emb_params": VECTORS[None]}, "shape"),
        ({"emb_params": VECTORS * float("nan")}, "NaN"),
    ],
)
def test_bad_files_are_one_line(tmp_path, tensors, message):
    with pytest.raises(UserError, match=message) as info:
        load_embedding(bad(tmp_path, "e.safetensors", tensors))
    assert "\n" not in str(info.value)


def test_missing_truncated_and_pickled_code(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_embedding(tmp_path / "nothere.pt")
    good = bad(tmp_path, "t.safetensors", {"emb_params": VECTORS})
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(UserError, match="truncated"):
        load_embedding(cut)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = tmp_path / "evil.pt"
    torch.save({"string_to_param": {"*": VECTORS}, "x": Evil()}, evil)
    with pytest.raises(UserError, match="never runs"):
        load_embedding(evil)


def test_ti_hashes_as_a1111_writes_them(tmp_path):
    from sdiree.runtime.embeddings import ti_hashes
    from sdiree.runtime.image_output import a1111_parameters

    path = bad(tmp_path, "my-cat.safetensors", {"emb_params": VECTORS})
    cat, odd = load_embedding(path), load_embedding(path, "<a:b,c>")
    h = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    assert ti_hashes([cat, odd, cat]) == f"my-cat: {h}, <abc>: {h}"
    assert ti_hashes([]) is None
    text = a1111_parameters(
        "p", "", 20, "Euler", 7.5, 1, 64, 64, "m", {"TI hashes": ti_hashes([cat])}
    )
    assert text.endswith(f'TI hashes: "my-cat: {h}"')
