"""A1111's ``<lora:name:strength>`` prompt tags, finding their files in a LoRA folder, and the
``Lora hashes`` A1111 writes for them (sha256 of a safetensors file's data, header skipped)."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from sdiree.runtime.errors import UserError
from sdiree.runtime.image_output import a1111_parameters
from sdiree.runtime.lora import (
    PromptLora,
    addnet_hash,
    extract_prompt_loras,
    lora_hashes_value,
    lora_short_hash,
    resolve_lora_name,
)


def test_tags_are_taken_out_of_the_prompt():
    prompt = "a cat <lora:detail:0.8>, <lyco:style v2> in snow <lora:x:0.5:1.2> <hypernet:h:1>"
    text, loras = extract_prompt_loras(prompt)
    assert text == "a cat ,  in snow  <hypernet:h:1>"
    assert loras == [
        PromptLora("detail", 0.8, 0.8, "<lora:detail:0.8>"),
        PromptLora("style v2", 1.0, 1.0, "<lyco:style v2>"),
        PromptLora("x", 1.2, 0.5, "<lora:x:0.5:1.2>"),
    ]
    _, (named,) = extract_prompt_loras("<lora:y:unet=0.3:te=-1>")
    assert (named.strength, named.te_strength) == (0.3, -1.0)
    _, (te_only,) = extract_prompt_loras("<lora:y:te=0.2>")
    assert (te_only.strength, te_only.te_strength) == (0.2, 0.2)
    assert extract_prompt_loras("no tags: <b>, <lora>") == ("no tags: <b>, <lora>", [])


@pytest.mark.parametrize(
    "tag, message",
    [
        ("<lora::0.8>", "<lora::0.8>: the LoRA's name is missing"),
        ("<lora:x:abc>", "<lora:x:abc>: strength 'abc' is not a number"),
        ("<lora:x:nan>", "<lora:x:nan>: strength nan is not a finite number"),
        ("<lora:x:1:inf>", "<lora:x:1:inf>: strength inf is not a finite number"),
        ("<lora:x:1:dyn=4>", "<lora:x:1:dyn=4>: dyn= is not supported (only te= and unet=)"),
        ("<lora:x:1:2:3>", "<lora:x:1:2:3>: too many values"),
    ],
)
def test_bad_tags_are_refused(tag, message):
    with pytest.raises(UserError) as e:
        extract_prompt_loras(f"a {tag} b")
    assert str(e.value).startswith(message)


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_names_resolve_in_the_folder_and_below(tmp_path):
    a = _touch(tmp_path / "a.safetensors")
    b = _touch(tmp_path / "sub" / "b.safetensors")
    c = _touch(tmp_path / "sub" / "deeper" / "c[1].safetensors")
    assert resolve_lora_name("a", tmp_path) == a.resolve()
    assert resolve_lora_name("a.safetensors", tmp_path) == a.resolve()
    assert resolve_lora_name("b", tmp_path) == b.resolve()
    assert resolve_lora_name("sub/b", tmp_path) == b.resolve()
    assert resolve_lora_name("c[1]", tmp_path) == c.resolve()


def test_names_that_resolve_to_nothing_are_refused(tmp_path):
    _touch(tmp_path / "one" / "twin.safetensors")
    _touch(tmp_path / "two" / "twin.safetensors")
    _touch(tmp_path / "old.pt")
    cases = [
        ("missing", tmp_path, f"<lora:missing>: no missing.safetensors in --lora-dir {tmp_path}"),
        ("x", None, "the prompt asks for <lora:x> but no --lora-dir was given"),
        ("x", tmp_path / "nope", f"--lora-dir {tmp_path / 'nope'} is not a folder"),
        ("../a", tmp_path, "<lora:../a>: the name leads out of --lora-dir"),
        ("twin", tmp_path, "<lora:twin>: several files in"),
        ("old", tmp_path, f"<lora:old>: {tmp_path / 'old.pt'} is not a .safetensors file"),
    ]
    for name, folder, message in cases:
        with pytest.raises(UserError) as e:
            resolve_lora_name(name, folder)
        assert str(e.value).startswith(message), str(e.value)


def _safetensors(path, tensors, metadata):
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)
    return path


def test_hash_is_sha256_of_the_data_after_the_header(tmp_path):
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    path = _safetensors(tmp_path / "a.safetensors", tensors, {"ss_output_name": "a"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8 : 8 + n])["__metadata__"] == {"ss_output_name": "a"}
    want = hashlib.sha256(np.arange(6, dtype="<f4").tobytes()).hexdigest()
    assert raw[8 + n :] == np.arange(6, dtype="<f4").tobytes()
    assert addnet_hash(path) == want
    assert lora_short_hash(path) == want[:12]
    # the metadata is not hashed, the tensors are
    renamed = _safetensors(tmp_path / "b.safetensors", tensors, {"ss_output_name": "other"})
    assert addnet_hash(renamed) == want
    changed = _safetensors(tmp_path / "c.safetensors", {"w": tensors["w"] + 1}, None)
    assert addnet_hash(changed) != want


def test_hash_of_a_file_that_is_not_safetensors_is_refused(tmp_path):
    for name, data in (("short", b"\x01\x02"), ("long", struct.pack("<Q", 10**9) + b"{}")):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(UserError, match=f"{path} is not a .safetensors file"):
            addnet_hash(path)


def test_lora_hashes_as_a1111_writes_them():
    value = lora_hashes_value(
        [("detail", "0123456789ab"), ("st:y,le", "ba9876543210"), ("detail", "ffffffffffff")]
    )
    assert value == "detail: 0123456789ab, style: ba9876543210"
    text = a1111_parameters(
        "a cat", "", 20, "Euler", 7.0, 1, 512, 512, "m", extra={"Lora hashes": value}
    )
    assert text.endswith('Lora hashes: "detail: 0123456789ab, style: ba9876543210"')
