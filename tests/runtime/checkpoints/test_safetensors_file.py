"""safetensors read and written without the safetensors library: bit-exact against it, views of
a read-only memory map, and damaged files refused in one line naming the file."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from sdiree.runtime.checkpoints.read import read_tensors
from sdiree.runtime.checkpoints.safetensors_file import read_safetensors, write_safetensors
from sdiree.runtime.errors import UserError

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((7,)).astype(np.float16),
        "f64": rng.standard_normal((2, 2, 2)),
        "i64": rng.integers(-(2**40), 2**40, (4,)),
        "i32": rng.integers(-1000, 1000, (3, 1)).astype(np.int32),
        "i8": rng.integers(-100, 100, (5,)).astype(np.int8),
        "u8": rng.integers(0, 255, (6,)).astype(np.uint8),
        "bool": rng.integers(0, 2, (3,)).astype(bool),
        "scalar": np.array(1.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def _base(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def test_reads_what_safetensors_writes_bit_exact_as_memmap_views(tmp_path):
    want = sample_tensors()
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file(want, str(path), metadata={"format": "pt", "note": "x"})
    got, metadata = read_safetensors(path)
    assert metadata == {"format": "pt", "note": "x"}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k
        assert not got[k].flags.writeable, k
    assert isinstance(_base(got["f32"]), np.memmap)  # no copy of the file's bytes


def test_bfloat16_both_ways(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    t = torch.randn(4, 3).to(torch.bfloat16)
    path = tmp_path / "bf16.safetensors"
    save_file({"w": t}, str(path))
    got, _ = read_safetensors(path)
    assert got["w"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert got["w"].view(np.int16).tobytes() == t.view(torch.int16).numpy().tobytes()
    out = tmp_path / "ours.safetensors"
    write_safetensors(out, got)
    assert torch.equal(load_file(str(out))["w"].view(torch.int16), t.view(torch.int16))


def test_what_we_write_reads_back_in_safetensors_bit_exact(tmp_path):
    want = sample_tensors()
    want["strided"] = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # not contiguous
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, want, {"format": "pt"})
    back = safetensors_numpy.load_file(str(path))
    assert list(back) == list(want) or set(back) == set(want)
    for k, v in want.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0  # data 8-byte aligned


def test_read_tensors_dispatches_on_content_not_name(tmp_path):
    path = tmp_path / "model.ckpt"  # a safetensors file with a pickle's name
    safetensors_numpy.save_file({"a": np.ones(3, np.float32)}, str(path))
    tf = read_tensors(path)
    assert tf.format == "safetensors" and np.array_equal(tf.tensors["a"], np.ones(3))
    import hashlib

    assert tf.sha256() == hashlib.sha256(path.read_bytes()).hexdigest()


def write_raw(path, header: dict | bytes, data: bytes = b"") -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def one_line_error(path, *must_say: str) -> str:
    with pytest.raises(UserError) as e:
        read_tensors(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for s in must_say:
        assert s in msg, msg
    return msg


def test_truncated_data_names_sizes(tmp_path):
    path = tmp_path / "cut.safetensors"
    safetensors_numpy.save_file({"w": np.zeros((64, 64), np.float32)}, str(path))
    full = path.read_bytes()
    path.write_bytes(full[: len(full) - 100])
    one_line_error(
        path,
        f"is truncated (header says {len(full)} bytes, file has {len(full) - 100})",
        "re-download",
    )


def test_truncated_inside_header(tmp_path):
    path = tmp_path / "cut.safetensors"
    safetensors_numpy.save_file({"w": np.zeros(4, np.float32)}, str(path))
    path.write_bytes(path.read_bytes()[:20])
    one_line_error(path, "is truncated", "re-download")


@pytest.mark.parametrize(
    "header,data,say",
    [
        (b"{not json", b"", "not JSON"),
        (b"[1, 2]", b"", "not a checkpoint"),
        ({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "dtype 'Q4'"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8, "needs 8 bytes"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "damaged"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlap",
        ),
        ({"__metadata__": {"a": 1}}, b"", "__metadata__"),
    ],
    ids=["not-json", "not-object", "dtype", "span", "shape", "overlap", "metadata"],
)
def test_damaged_headers_are_one_line(tmp_path, header, data, say):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data)
    one_line_error(path, say)


def test_huge_header_length_is_not_safetensors(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 2**60) + b"{" + b"\0" * 20)
    one_line_error(path, "not a checkpoint")


def test_not_a_checkpoint_and_empty(tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("hello, this is not a model\n")
    one_line_error(text, "is a text file, not a checkpoint", "'hello, this is not a model'")
    other = tmp_path / "notes.txt"
    other.write_bytes(b"\x01\x02 binary, not a model")
    one_line_error(other, "is not a checkpoint sdiree reads")
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    one_line_error(empty, "is empty")
    with pytest.raises(UserError, match="does not exist"):
        read_tensors(tmp_path / "missing.safetensors")


LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4c2d8f5e3c1a2b9e0d7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d\n"
    "size 3438167536\n"
)
FAILED_DOWNLOADS = {
    "lfs-pointer": (
        LFS_POINTER,
        ["is a Git LFS pointer (", "not the file of 3.4 GB itself", "git lfs pull"],
    ),
    "html-page": (
        "\n  <!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>" + "x" * 900,
        ["is a web page (HTML), not a checkpoint", "'<!DOCTYPE html> <html><head>", "again"],
    ),
    "json-error": (
        '{"error": "Unauthorized", "message": "The model requires a login"}',
        ["is a JSON text, not a checkpoint", '\'{"error": "Unauthorized"', "API token"],
    ),
}


@pytest.mark.parametrize("case", list(FAILED_DOWNLOADS))
def test_failed_downloads_say_what_they_are(tmp_path, case):
    """What a failed download leaves where a checkpoint should be is named, with what to do:
    a Git LFS pointer (a repository cloned without git-lfs), a login page, an error message."""
    text, says = FAILED_DOWNLOADS[case]
    for name in ("model.safetensors", "model.ckpt"):
        path = tmp_path / name
        path.write_text(text)
        one_line_error(path, *says)


def test_damaged_file_named_as_a_checkpoint(tmp_path):
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"\x00\x01" + bytes(range(256)) * 4)
    one_line_error(path, "is not a checkpoint, though its name says one", "re-download")
