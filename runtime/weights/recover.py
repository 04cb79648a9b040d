"""Weights an artifact does not keep, read back from its encoded (pre-packed) archives.

On cpu every weight reaches the modules through the encoded archives (data-tiled copies, and
3x3 convolutions Winograd-transformed); the original-weight archives are then read by nothing
in a plain run, only by what derives new weights from the old (`--lora`, a partial
`--weights`, the embeddings' token table). The compile therefore keeps of an original archive
only the keys a module loads by name, and lists the rest, with their shapes and dtypes, in a
sidecar `<archive>.pruned.json` (compile/prune.py). Each listed key is read back here from a
packed copy described by the encoder's learned layout (weights/layout.py): a packed copy is a
strided view of the zero-padded weight, so it is unpacked exactly; a 3x3 weight kept only as
its Winograd transform U = G g G^T is recovered as g = K+ U (K = kron(G, G), K+ its
pseudo-inverse), within a few float32 ulps; where a module reads U itself (an untiled matmul,
specs/tuning/cpu_avx2_winograd_untiled.mlir), from the raw derived archive the artifact keeps
beside the original (a source `{"archive": file}`); a linear's weight that a module reads as
panels (`<linear>.weight_panels`, runtime/weights/derived.py) is read back from those, exactly.
The compile checks every listed key this way against the original before it drops it.

A bf16 artifact's encoders pack weights in bf16: such a weight reads back as its bf16
rounding (`Recoverer.rounded`), the weight its modules compute with. The compile drops it only
as that (exactly the original rounded to bf16 to nearest even; through a Winograd inverse,
within layout.BF16_TOLERANCE of the largest magnitude), so a LoRA on a bf16 artifact adds to the bf16
weights, as a bf16 torch pipeline's fused LoRA does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .derived import PANEL_WIDTH, PANELS_PARAM, unpanel
from .layout import Layout, Region, from_bf16
from .pages import entry_views, release_pages
from .winograd import WINOGRAD, WINOGRAD_PARAM

SIDECAR_SUFFIX = ".pruned.json"
FORMAT_VERSION = 2  # 2: sources may be raw archives (`{"archive": file}`) besides packed ones
READABLE_VERSIONS = (1, 2)


def sidecar_path(archive: Path) -> Path:
    return archive.with_name(archive.name + SIDECAR_SUFFIX)


def unpack(region: Region, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(weight, covered) from region's packed copy `data` (flat, the weight's dtype): the
    weight of shape region.shape, and a mask of the elements the copy holds."""
    padded = region.padded()
    out, seen = np.zeros(padded, data.dtype), np.zeros(padded, np.bool_)
    region.view(out, writeable=True)[...] = data.reshape([c for _, _, c in region.levels])
    region.view(seen, writeable=True)[...] = True
    inner = tuple(slice(0, s) for s in region.shape)
    return out[inner], seen[inner]


def winograd_inverse(u: np.ndarray) -> np.ndarray:
    """The [O, C, 3, 3] weight g of a Winograd-transformed one u = [(m+2)^2, C, O] (see
    winograd.winograd_weight), in float64, in u's dtype."""
    taps, c, o = u.shape
    t = round(taps**0.5)
    g = np.asarray(WINOGRAD[t - 2][1], np.float64)
    k_inv = np.linalg.pinv(np.kron(g, g))  # [9, t*t]
    w = k_inv @ np.asarray(u, np.float64).reshape(taps, c * o)
    return (
        np.ascontiguousarray(w.reshape(9, c, o).transpose(2, 1, 0))
        .reshape(o, c, 3, 3)
        .astype(u.dtype)
    )


class Recoverer:
    """Reads keys back from the encoded archives and layouts a sidecar names."""

    def __init__(self, root: Path, sources: list[dict]):
        self.root = Path(root)
        # [{"encoded": file, "layout": file} or {"archive": file}], relative to root
        self.sources = sources
        self._loaded: list[tuple[Layout, dict[str, np.ndarray], dict]] | None = None
        self._raw: list[dict[str, np.ndarray]] | None = None
        self.rounded: set[str] = set()  # keys read back from bf16 packs: their bf16 rounding

    def _load(self) -> list:
        if self._loaded is None:
            self._loaded = []
            for s in self.sources:
                if "archive" in s:
                    continue
                layout = Layout.load(self.root / s["layout"])
                if layout is None:
                    raise ValueError(f"{self.root / s['layout']}: not a readable layout")
                views = entry_views(self.root / s["encoded"])
                self._loaded.append((layout, views, layout.regions_of()))
        return self._loaded

    def _packed(self, key: str, dtype: np.dtype) -> np.ndarray | None:
        """key's float32 weight unpacked from packed copies that hold all of it: float32 ones,
        else bf16 ones (then its bf16 rounding, and key joins `rounded`)."""
        for packs in ("f32", "bf16"):
            for layout, views, by_param in self._load():
                if key in layout.unverified:
                    continue
                w = covered = None  # a weight may come in slices (a split Winograd conv's)
                for entry, region in by_param.get(key, ()):
                    if region.dtype != packs or (packs == "bf16" and dtype != np.float32):
                        continue
                    n = region.size() * region.itemsize
                    data = views[entry][region.offset : region.offset + n]
                    data = data.view(dtype) if packs == "f32" else from_bf16(data.view(np.uint16))
                    part, seen = (a.reshape(-1) for a in unpack(region, data))
                    release_pages(views[entry], region.offset, region.offset + n)  # read once
                    if w is None:
                        w, covered = part, seen
                    else:
                        w, covered = np.where(seen, part, w), covered | seen
                    if covered.all():
                        if packs == "bf16":
                            self.rounded.add(key)
                        return w
        return None

    def _unpacked(self, key: str, dtype: np.dtype) -> np.ndarray | None:
        """key as a raw archive among the sources holds it (not read back: its own entry)."""
        if self._raw is None:
            self._raw = [entry_views(self.root / s["archive"]) for s in self.sources
                         if "archive" in s]  # fmt: skip
        for views in self._raw:
            if key in views:
                return np.array(views[key].view(dtype))
        return None

    def array(self, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The weight key (shape, dtype), read back; KeyError when no layout holds it."""
        w = self._packed(key, dtype)
        if w is not None:
            return w.reshape(shape)
        if key.endswith(".weight") and len(shape) == 4 and shape[2:] == (3, 3):
            name = key[: -len("weight")] + WINOGRAD_PARAM
            u = self._packed(name, dtype)
            if u is None:
                u = self._unpacked(name, dtype)
            if u is not None:
                if name in self.rounded:
                    self.rounded.add(key)
                taps = u.size // (shape[0] * shape[1])
                return winograd_inverse(u.reshape(taps, shape[1], shape[0]))
        if key.endswith(".weight") and len(shape) == 2 and shape[0] % PANEL_WIDTH == 0:
            panels = self._unpacked(key[: -len("weight")] + PANELS_PARAM, dtype)
            if panels is not None and panels.size == shape[0] * shape[1]:
                return unpanel(panels.reshape(shape[0] // PANEL_WIDTH, shape[1], PANEL_WIDTH))
        raise KeyError(key)


def read_sidecar(archive: Path) -> tuple[dict[str, tuple[tuple[int, ...], str]], Recoverer] | None:
    """({key: (shape, dtype name)} the archive at path lacks, their Recoverer), or None when
    the archive is whole (no sidecar)."""
    path = sidecar_path(Path(archive))
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    if d.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{path}: sidecar version {d.get('version')}, expected one of {READABLE_VERSIONS}"
        )
    keys = {k: (tuple(v["shape"]), v["dtype"]) for k, v in d["keys"].items()}
    return keys, Recoverer(path.parent, d["from"])
