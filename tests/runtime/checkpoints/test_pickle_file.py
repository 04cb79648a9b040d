"""torch zip checkpoints read without torch: bit-exact tensors of every dtype, views at their
offsets and strides, Lightning's nesting, and pickles that carry code refused unrun."""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest

from sdiree.runtime.checkpoints.read import read_tensors
from sdiree.runtime.errors import UserError

torch = pytest.importorskip("torch")

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def as_bytes(t) -> bytes:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def random_tensor(dtype, shape=(3, 4)):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _base(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def test_every_dtype_round_trips_bit_exact(tmp_path):
    state = {str(d).split(".")[1]: random_tensor(d) for d in DTYPES}
    path = tmp_path / "model.ckpt"
    torch.save(state, path)
    tf = read_tensors(path)
    assert tf.format == "torch-zip"
    assert set(tf.tensors) == set(state)
    for k, t in state.items():
        got = tf.tensors[k]
        assert got.shape == tuple(t.shape), k
        assert got.tobytes() == as_bytes(t), k
        assert not got.flags.writeable, k
    assert isinstance(_base(tf.tensors["float32"]), np.memmap)  # not copied


def test_views_offsets_strides_shared_storage_and_parameters(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {
        "whole": base,
        "transposed": base.t(),
        "slice": base[2:5, 1::3],
        "row": base[4],
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "views.pt"
    torch.save(state, path)
    got = read_tensors(path).tensors
    for k, t in state.items():
        assert np.array_equal(got[k], t.detach().numpy()), k
        assert got[k].shape == tuple(t.shape), k
    assert np.shares_memory(got["whole"], got["slice"])  # one storage, two views


def test_lightning_checkpoint_state_dict_and_plain_values(tmp_path):
    inner = {"model.diffusion_model.w": torch.ones(2, 3)}
    ckpt = {
        "state_dict": inner,
        "global_step": 875000,
        "epoch": 3,
        "pytorch-lightning_version": "1.4.2",
        "hparams": {"lr": 1e-4, "betas": (0.9, 0.99), "names": ["a", "b"]},
        "loops": None,
    }
    path = tmp_path / "last.ckpt"
    torch.save(ckpt, path)
    tf = read_tensors(path)
    assert list(tf.tensors) == ["model.diffusion_model.w"]
    assert tf.extras["global_step"] == 875000 and tf.extras["epoch"] == 3
    assert tf.extras["pytorch-lightning_version"] == "1.4.2"


def test_numpy_scalars_beside_the_state_dict(tmp_path):
    path = tmp_path / "np.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "best": np.float64(0.25)}, path)
    tf = read_tensors(path)
    assert tf.extras["best"] == 0.25


class RunsCommand:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


@pytest.mark.parametrize(
    "func,name",
    [
        (os.system, f"{os.system.__module__}.system"),
        (eval, "builtins.eval"),
        (exec, "builtins.exec"),
    ],
    ids=["os.system", "eval", "exec"],
)
def test_code_in_the_pickle_is_refused_and_never_run(tmp_path, func, name):
    marker = tmp_path / "pwned"
    arg = f"touch {marker}" if func is os.system else f"open({str(marker)!r}, 'w').close()"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "payload": RunsCommand(func, arg)}, path)
    with pytest.raises(UserError) as e:
        read_tensors(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"contains code ({name}), which sdiree never runs" in msg, msg
    assert "convert the file to .safetensors" in msg
    assert not marker.exists()


def test_legacy_torch_pickle_is_refused(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UserError, match="old-format torch checkpoint"):
        read_tensors(path)


def test_truncated_zip_and_foreign_zip(tmp_path):
    path = tmp_path / "cut.ckpt"
    torch.save({"w": torch.zeros(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="truncated or damaged") as e:
        read_tensors(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    other = tmp_path / "archive.pt"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(UserError, match="zip file but not a torch checkpoint"):
        read_tensors(other)


def test_compressed_members_are_read_too(tmp_path):
    state = {"w": random_tensor(torch.float16, (5, 7)), "b": random_tensor(torch.int64, (3,))}
    path = tmp_path / "stored.pt"
    torch.save(state, path)
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    got = read_tensors(deflated).tensors
    for k, t in state.items():
        assert got[k].tobytes() == as_bytes(t), k


def test_bare_pickle_is_refused(tmp_path):
    import pickle

    path = tmp_path / "x.pkl"
    path.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    with pytest.raises(UserError, match="bare Python pickle"):
        read_tensors(path)


def test_nested_dicts_give_dotted_names(tmp_path):
    """A1111's textual-inversion .pt: tensors in a dict inside the top-level one."""
    path = tmp_path / "my-cat.pt"
    emb = torch.randn(2, 8)
    torch.save({"string_to_param": {"*": emb}, "name": "my-cat", "step": 3000}, path)
    tf = read_tensors(path)
    assert np.array_equal(tf.tensors["string_to_param.*"], emb.numpy())
    assert tf.extras["name"] == "my-cat" and tf.extras["step"] == 3000
