"""Read torch's zip checkpoints (.ckpt, .pt, .bin) without torch and without running their code.

torch.save writes a zip: `<name>/data.pkl`, a pickle of the object saved, and one member
`<name>/data/<key>` per tensor storage, stored uncompressed. A pickle may name any importable
callable and have it called while loading, so the one in a downloaded file is read by a
restricted unpickler: its `find_class` hands out stand-ins for the few things a state dict
needs (torch's tensor rebuild functions, storage types, OrderedDict, numpy scalars, Lightning's
ModelCheckpoint as inert data) and refuses every other name before anything is called. Storages
become numpy arrays over a read-only memory map of the zip member (a copy only where a member
is compressed), and each tensor a view of its storage at its offset, sizes and strides.
"""

from __future__ import annotations

import collections
import math
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path

import numpy as np

from ..errors import UserError

CONVERT = "convert the file to .safetensors"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra field length


def _bf16() -> np.dtype:
    import ml_dtypes  # iree-base-runtime's dependency

    return np.dtype(ml_dtypes.bfloat16)


# torch's typed storage classes -> element dtype (little-endian unless the archive says not)
_STORAGES = {
    "FloatStorage": "<f4",
    "HalfStorage": "<f2",
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": "<f8",
    "LongStorage": "<i8",
    "IntStorage": "<i4",
    "ShortStorage": "<i2",
    "CharStorage": "i1",
    "ByteStorage": "u1",
    "BoolStorage": "?",
}


class _StorageType:
    """Stands in for torch.FloatStorage and the like: only its dtype is used."""

    def __init__(self, name: str):
        self.name = name
        self.dtype = _bf16() if _STORAGES[name] == "bfloat16" else np.dtype(_STORAGES[name])


class _TensorClass:
    """Stands in for torch.Tensor and torch.nn.Parameter where a pickle names them as types."""


class _Inert:
    """Stands in for a class whose objects are bookkeeping data (Lightning's ModelCheckpoint
    callback state): takes any arguments and state, does nothing with them."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> np.ndarray:
    """torch._utils._rebuild_tensor(_v2): a view of storage at offset with sizes and strides."""
    ints = (storage_offset, *size, *stride)
    if (
        not isinstance(storage, np.ndarray)
        or storage.ndim != 1
        or not isinstance(size, (tuple, list))
        or not isinstance(stride, (tuple, list))
        or len(size) != len(stride)
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints)
    ):
        raise _Damaged("a tensor record is malformed")
    size, stride = tuple(size), tuple(stride)
    numel = math.prod(size)
    if numel == 0:
        empty = np.zeros(size, dtype=storage.dtype)
        empty.flags.writeable = False
        return empty
    last = storage_offset + sum((d - 1) * s for d, s in zip(size, stride, strict=True))
    if last >= storage.shape[0]:
        raise _Damaged("a tensor reaches past the end of its storage")
    contiguous, step = [], 1
    for d in reversed(size):
        contiguous.insert(0, step)
        step *= d
    if all(d == 1 or s == c for d, s, c in zip(size, stride, contiguous, strict=True)):
        return storage[storage_offset : storage_offset + numel].reshape(size)
    item = storage.dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        storage[storage_offset:],
        shape=size,
        strides=tuple(s * item for s in stride),
        writeable=False,
    )


def _rebuild_parameter(data, *_ignored):
    """torch._utils._rebuild_parameter(_with_state): a Parameter is its data here."""
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    """torch._tensor._rebuild_from_type_v2: rebuild with func (itself one of these stand-ins,
    as find_class gave it) and ignore the subclass."""
    if func not in (_rebuild_tensor, _rebuild_parameter) or new_type is not _TensorClass:
        raise _Damaged("a tensor subclass record is malformed")
    return func(*args)


def _codecs_encode(text, encoding="utf-8"):
    """_codecs.encode as pickles of bytes use it (protocol 2 stores bytes as latin-1 text)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise _Damaged("a bytes record is malformed")
    return text.encode(encoding)


def _numpy_dtype(spec, align=False, copy=False):
    """numpy.dtype as numpy scalars' pickles name it: a plain type code such as 'f8' only."""
    if not isinstance(spec, str) or not re.fullmatch(r"[<>|=]?[a-zA-Z]\d*", spec):
        raise _Damaged("a numpy dtype record is malformed")
    return np.dtype(spec)


def _numpy_scalar(dtype, data=None):
    """numpy.core.multiarray.scalar: one value of dtype from its bytes."""
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
        raise _Damaged("a numpy scalar record is malformed")
    if len(data) != dtype.itemsize:
        raise _Damaged("a numpy scalar record is malformed")
    return np.frombuffer(data, dtype=dtype)[0]


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorClass,
    ("torch.nn.parameter", "Parameter"): _TensorClass,
    ("torch", "Size"): tuple,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("_codecs", "encode"): _codecs_encode,
    ("numpy", "dtype"): _numpy_dtype,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    ("pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint"): _Inert,
    ("lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint"): _Inert,
}


# Protocol 2 pickles name some modules by their Python 2 names (pickle's fix_imports).
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class _Damaged(Exception):
    """A record the restricted unpickler cannot make sense of (reported as a damaged file)."""


class _Refused(Exception):
    """A name the pickle asked for that sdiree never calls."""


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storage_array):
        super().__init__(file)
        self._storage_array = storage_array
        self._storages: dict[str, np.ndarray] = {}

    def find_class(self, module, name):
        module = _PY2_MODULES.get(module, module)
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        found = _ALLOWED.get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid):
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str)
            or not isinstance(pid[4], int)
        ):
            raise _Damaged(f"a storage record is malformed ({str(pid)[:60]})")
        _, storage_type, key, _location, numel = pid
        if key not in self._storages:
            self._storages[key] = self._storage_array(key, storage_type.dtype, numel)
        return self._storages[key]


def _member_offset(fh, info: zipfile.ZipInfo) -> int:
    """Where a zip member's bytes start in the file (after its local header)."""
    fh.seek(info.header_offset)
    raw = fh.read(_LOCAL_HEADER.size)
    if len(raw) < _LOCAL_HEADER.size:
        raise _Damaged(f"member {info.filename} lies past the end of the file")
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(raw)
    if signature != b"PK\x03\x04":
        raise _Damaged(f"member {info.filename} has no local header")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def _prefix(path: Path, names: list[str]) -> str:
    pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if not pickles:
        raise UserError(
            f"{path} is a zip file but not a torch checkpoint (no <name>/data.pkl in it); pass "
            "a .safetensors or torch .ckpt/.pt file"
        )
    return pickles[0][: -len("data.pkl")]


def read_torch_zip(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """({name: array} of the state dict, {name: value} of the plain values beside it, such as
    global_step) of a torch zip checkpoint; UserError when it is damaged or carries code."""
    path = Path(path)
    size = os.path.getsize(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise UserError(
            f"{path} is truncated or damaged (its zip directory is unreadable: {e}); re-download it"
        ) from None
    with zf, open(path, "rb") as fh:
        names = zf.namelist()
        prefix = _prefix(path, names)
        big_endian = prefix + "byteorder" in names and zf.read(prefix + "byteorder") == b"big"
        whole = np.memmap(path, dtype=np.uint8, mode="r") if size else None

        def storage_array(key: str, dtype: np.dtype, numel: int) -> np.ndarray:
            name = f"{prefix}data/{key}"
            try:
                info = zf.getinfo(name)
            except KeyError:
                raise _Damaged(f"storage {key} is missing (no member {name})") from None
            if big_endian:
                dtype = dtype.newbyteorder(">")
            nbytes = numel * dtype.itemsize
            if info.file_size < nbytes:
                raise _Damaged(f"storage {key} holds {info.file_size} bytes, not {nbytes}")
            if info.compress_type == zipfile.ZIP_STORED:
                start = _member_offset(fh, info)
                if start + nbytes > size:
                    raise _Damaged(f"storage {key} lies past the end of the file")
                return whole[start : start + nbytes].view(dtype)
            return np.frombuffer(zf.read(name)[:nbytes], dtype=dtype)

        try:
            with zf.open(prefix + "data.pkl") as f:
                obj = _Unpickler(f, storage_array).load()
        except _Refused as e:
            raise UserError(
                f"{path} contains code ({e}), which sdiree never runs; {CONVERT}"
            ) from None
        except (_Damaged, zipfile.BadZipFile, EOFError) as e:
            raise UserError(f"{path} is damaged ({e}); re-download it or {CONVERT}") from None
        except (
            pickle.UnpicklingError,
            TypeError,
            ValueError,
            AttributeError,
            IndexError,
            KeyError,
            RecursionError,
            OverflowError,
            struct.error,
        ) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"{path} is damaged (its pickle does not load: {why}); re-download it or {CONVERT}"
            ) from None
    return _state_dict(path, obj)


def _state_dict(path: Path, obj) -> tuple[dict[str, np.ndarray], dict]:
    """The tensors of the state dict (under "state_dict" in Lightning checkpoints, as deep as it
    nests; a dict inside it gives dotted names, as A1111's embeddings' "string_to_param.*") and
    the plain values found on the way (global_step)."""
    extras: dict = {}
    while isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        extras.update(
            {k: v for k, v in obj.items() if isinstance(k, str) and _plain(v) and k != "state_dict"}
        )
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise UserError(
            f"{path} holds a {type(obj).__name__}, not a state dict of named tensors; pass a "
            "model checkpoint"
        )
    tensors: dict[str, np.ndarray] = {}
    _flatten(obj, "", tensors, extras)
    return tensors, extras


def _flatten(d: dict, prefix: str, tensors: dict, extras: dict) -> None:
    for k, v in d.items():
        if not isinstance(k, str):
            continue
        if isinstance(v, np.ndarray):
            tensors[prefix + k] = v
        elif isinstance(v, dict):
            _flatten(v, f"{prefix}{k}.", tensors, extras)
        elif _plain(v):
            extras.setdefault(prefix + k, v)


def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool)) or (
        isinstance(value, np.generic) and not isinstance(value, np.ndarray)
    )
