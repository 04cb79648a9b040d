"""How a parameter encoder lays out each weight, and a few changed weights (a LoRA) re-packed
by it in numpy instead of by re-running the encoder over all of them.

On cpu the encoder's output is a repack (data tiling: tiles, padding, transposes) of each
weight, written at fixed places of one entry. A `Region` is one packed copy: a strided view of
the zero-padded weight (per output axis, the weight dimension it walks, its step and its
count). A `Layout` holds every entry's regions, saved beside the artifact as
`<submodule>.layout.json`; it is learned once (layout_learn.py, from coded weights:
layout_codes.py) and is `complete` when no byte outside the regions depends on the weights.
Only then is it used, and only for weights all of whose regions verified; anything else goes
through the encoder. A bf16 artifact's regions (`Region.dtype` "bf16") re-pack a weight as its
bf16 rounding, to nearest even, as the encoder does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# 2: regions may be bf16 (Region.dtype); written only then, so a reader of 1 that would take
# them for float32 refuses the layout (and runs the encoder) instead
FORMAT_VERSION, FORMATS_READ = 2, (1, 2)
# The learner: 2 reads bf16 packs. A layout an older one left incomplete is learned again
# (Layout.settled: by the compile, and for the user cache's by the runtime).
LEARNER_VERSION = 2
# A bf16 weight recomputed from bf16-rounded ones (a pruned bf16 artifact's, through the
# Winograd inverse) is within this share of its largest magnitude, not that weight's rounding
BF16_TOLERANCE = 2.0**-6


def narrow_dtype(dtype: str) -> bool:
    """Whether an artifact of this dtype packs weights in bf16: cpu's bf16 demotes every
    contraction's inputs to bf16, and its encoder rounds the packed weights (learn(narrow))."""
    return dtype == "bf16"


@dataclass(frozen=True)
class Region:
    """One packed copy of `param` at byte `offset` of an encoded entry: the weight (shape
    `shape`, unit dimensions dropped) zero-padded, then read from `origin` (an index into it;
    a slice of a weight, e.g. one tile element of a split Winograd conv's, starts past 0) as a
    strided view with one axis per level (dim, step, count), outermost first."""

    param: str
    offset: int
    shape: tuple[int, ...]
    levels: tuple[tuple[int, int, int], ...]
    origin: tuple[int, ...] = ()  # () is every dim's 0
    dtype: str = "f32"  # the packed copy's elements: "f32", or "bf16" (rounded to nearest even)

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "bf16" else 4

    def cast(self, packed: np.ndarray) -> np.ndarray:
        """A float32 packed copy in the region's element type (bf16: its uint16 bits)."""
        return to_bf16(packed) if self.dtype == "bf16" else packed

    def start(self) -> tuple[int, ...]:
        return self.origin or (0,) * len(self.shape)

    def padded(self) -> tuple[int, ...]:
        reach = [o + 1 for o in self.start()]
        for d, step, count in self.levels:
            reach[d] += step * (count - 1)
        return tuple(max(s, r) for s, r in zip(self.shape, reach, strict=True))

    def size(self) -> int:
        return int(np.prod([c for _, _, c in self.levels], dtype=np.int64))

    def pack(self, w: np.ndarray, fill=0) -> np.ndarray:
        """The packed copy of w (any shape whose non-unit dims are `shape`), flat."""
        return np.ascontiguousarray(self.strided(w, fill)).reshape(-1)

    def strided(self, w: np.ndarray, fill=0) -> np.ndarray:
        """The packed copy of w as a strided view (one axis per level) of w, padded."""
        w = np.asarray(w).reshape(self.shape)
        padded = self.padded()
        if padded != self.shape:
            p = np.full(padded, fill, w.dtype)
            p[tuple(slice(0, s) for s in self.shape)] = w
            w = p
        else:
            w = np.ascontiguousarray(w)
        return self.view(w, writeable=False)

    def view(self, padded: np.ndarray, writeable: bool) -> np.ndarray:
        """The region's strided view (one axis per level) of an array of shape padded()."""
        at = padded[tuple(slice(o, None) for o in self.start())]
        strides = [padded.strides[d] * step for d, step, _ in self.levels]
        return np.lib.stride_tricks.as_strided(
            at, [c for _, _, c in self.levels], strides, writeable=writeable
        )

    def to_json(self) -> list:
        j = [self.param, self.offset, list(self.shape), [list(x) for x in self.levels]]
        if self.dtype != "f32":
            return [*j, list(self.origin), self.dtype]
        return j + [list(self.origin)] if any(self.origin) else j

    @staticmethod
    def from_json(j) -> Region:
        origin = tuple(int(x) for x in j[4]) if len(j) > 4 and any(j[4]) else ()
        dtype = str(j[5]) if len(j) > 5 else "f32"
        if dtype not in ("f32", "bf16"):
            raise ValueError(f"region of unknown element type {dtype!r}")
        levels = tuple(tuple(x) for x in j[3])
        return Region(str(j[0]), int(j[1]), tuple(j[2]), levels, origin, dtype)


def from_bf16(u: np.ndarray) -> np.ndarray:
    """The float32 values of bf16 bits (uint16)."""
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_bf16(a: np.ndarray) -> np.ndarray:
    """The uint16 bits of float32 a rounded to bf16, to nearest even (as the encoder rounds)."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    r = b >> 16  # in place from here: one temporary, not five (the layout check packs GBs)
    r &= 1
    r += b
    r += 0x7FFF
    r >>= 16
    return r.astype(np.uint16)


@dataclass
class Layout:
    """The regions of every encoded entry; `complete` when nothing else depends on weights."""

    entries: dict[str, list[Region]] = field(default_factory=dict)
    complete: bool = False
    unverified: set[str] = field(default_factory=set)  # params with a region that did not
    gave_up: bool = False  # learning ran past budget_s() (not saved: the layout is incomplete)
    learner: int = LEARNER_VERSION  # the learner that made it (1: one before bf16 packs)

    def regions_of(self) -> dict[str, list[tuple[str, Region]]]:
        out: dict[str, list[tuple[str, Region]]] = {}
        for entry, regions in self.entries.items():
            for r in regions:
                out.setdefault(r.param, []).append((entry, r))
        return out

    @property
    def settled(self) -> bool:
        """Complete, or learned by this learner: no reason to learn it again."""
        return self.complete or self.learner >= LEARNER_VERSION

    def narrow(self) -> bool:
        """Whether any region is a bf16 pack."""
        return any(r.dtype != "f32" for rs in self.entries.values() for r in rs)

    def covers(self, params) -> bool:
        """Whether every param in params can be re-packed here (regions verified, or none)."""
        return self.complete and not (set(params) & self.unverified)

    def save(self, path: Path) -> None:
        from ..fileutil import atomic_write_json

        atomic_write_json(
            path,
            {
                "version": FORMAT_VERSION if self.narrow() else 1,
                "learner": self.learner,
                "complete": self.complete,
                "unverified": sorted(self.unverified),
                "entries": {k: [r.to_json() for r in v] for k, v in self.entries.items()},
            },
        )

    @staticmethod
    def load(path: Path) -> Layout | None:
        try:
            d = json.loads(Path(path).read_text())
            if d.get("version") not in FORMATS_READ:
                return None
            entries = {k: [Region.from_json(r) for r in v] for k, v in d["entries"].items()}
            learner = int(d.get("learner", 1))
            return Layout(entries, bool(d["complete"]), set(d["unverified"]), learner=learner)
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None


def squeeze(shape) -> tuple[int, ...]:
    s = tuple(int(x) for x in shape if int(x) != 1)
    return s or (1,)


def repack(layout: Layout, views: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> int:
    """Write each weight's packed copies into views ({entry: writable uint8}); bytes written."""
    by_param = layout.regions_of()
    written = 0
    for key, w in weights.items():
        for entry, r in by_param.get(key, ()):
            src = r.cast(r.strided(w))
            n = r.size() * src.itemsize
            dst = views[entry][r.offset : r.offset + n].view(src.dtype).reshape(src.shape)
            np.copyto(dst, src)  # straight into the (copy-on-write) pages: one copy
            written += n
    return written
