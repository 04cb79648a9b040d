"""VAE decode and encode in overlapping tiles, blended as diffusers' AutoencoderKL tiling does.

With `enable_tiling()`, diffusers cuts the input into square tiles (`tile_latent_min_size`
latents, `tile_sample_min_size` = the VAE config's `sample_size` pixels) starting every 3/4 of a
tile, runs the VAE on each, then walks the tiles in row order: the top quarter of each tile is
faded in over the bottom of the (already blended) tile above, its left quarter over the right of
the tile to its left, linearly (weight y/extent), and the first 3/4 of each tile is kept. Tiles
at the bottom and right edges are shorter, and diffusers runs the VAE on them at their own size.

The tiler here does the same arithmetic in numpy over any per-tile function, one row of tiles
at a time (so only two rows are held), with one difference the caller controls: a compiled VAE
module takes fixed shapes only. A short edge tile whose shape the function takes (`shapes`) is
run as it is: the result is diffusers' own to rounding. Any other short tile is taken from a
full-size tile moved inward to end at the edge (padded where the input is smaller than a tile).
That tile sees different context, and the VAE's GroupNorm statistics and mid-block attention
span the whole tile, so the edge then differs from diffusers': on the tiny random-weight test VAE
that measured 21-30 dB against diffusers' tiled decode (padding the short tile instead: 20-28
dB; tests/runtime/test_vae_tiling.py keeps it below 40). `sdiree compile` therefore compiles
the VAE with one entry function per tile shape the artifact's image size needs (`tile_shapes`),
and the moved-inward tile serves only modules that lack a shape.

`plan_vae` (and `check_decode`, for a run's up-front checks) picks whole or tiled work from the
shapes the manifest declares: a module compiled at the tile size (`sdiree compile --vae-tile`)
can only tile, one compiled for the whole image decodes it whole (it is one tile);
`decode_latents` / `encode_image` then run it on a Session.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from .errors import UserError
from .host_memory import release_freed_heap

OVERLAP = 0.25  # diffusers' tile_overlap_factor
SCALE = 8  # image pixels per latent (SD's VAEs: four blocks)
MODES = ("auto", "on", "off")
# Working memory of one VAE call per image pixel per batch item, in fp32, beyond the weights:
# the SD 1.5-size VAE decoder on cpu took 2014 MiB of heap for a 512x512 tile
# (tools/vae_tiling_bench.py). The encoder is taken as the same (not measured). Estimates for
# budgets, not bounds.
DECODE_BYTES_PER_PIXEL = 8000
ENCODE_BYTES_PER_PIXEL = 8000

Shape = tuple[int, int]


def tile_starts(size: int, tile: int, overlap: float = OVERLAP) -> list[int]:
    """Where diffusers starts tiles along a side of `size`: every tile*(1-overlap) below size."""
    return list(range(0, size, int(tile * (1 - overlap))))


def tile_shapes(size_hw: Shape, tile: int, overlap: float = OVERLAP) -> list[Shape]:
    """Every distinct input shape of diffusers' tiles over size_hw, the first tile's first
    (the whole input when it fits in one tile: diffusers does not tile it)."""
    h, w = size_hw
    if h <= tile and w <= tile:
        return [(h, w)]
    rows = [min(tile, h - i) for i in tile_starts(h, tile, overlap)]
    cols = [min(tile, w - j) for j in tile_starts(w, tile, overlap)]
    return list(dict.fromkeys((r, c) for r in rows for c in cols))


def check_tile(tile_px: int, scale: int = SCALE) -> None:
    """A tile side diffusers' tiling arithmetic is consistent for: its quarter overlap in
    whole latents, so the kept 3/4 of each tile is exactly the stride between tiles."""
    step = 4 * scale
    if tile_px < step or tile_px % step:
        raise UserError(
            f"--vae-tile {tile_px} is not a positive multiple of {step} px (tiles overlap by a "
            f"quarter of their side, in whole latents of {scale} px); use e.g. 512, or 0 to "
            "decode whole"
        )


def decode_tiled(
    decode_tile: Callable,
    latents: np.ndarray,
    *,
    tile_latent: int,
    overlap: float = OVERLAP,
    scale: int = SCALE,
    shapes: Collection[Shape] | None = None,
):
    """Decode latents [B, C, h, w] tile by tile as diffusers' `tiled_decode`.

    decode_tile maps a latent tile [B, C, th, tw] to an image tile [B, C', th*scale, tw*scale]
    (or a tuple of such arrays, each blended alike). shapes: the (th, tw) it takes; None: any.
    The full tile (tile_latent, tile_latent) must be among them when some edge tile is not.
    """
    return _tiled(decode_tile, latents, tile_latent, tile_latent * scale, overlap, scale, 1, shapes)


def encode_tiled(
    encode_tile: Callable,
    image: np.ndarray,
    *,
    tile_sample: int,
    overlap: float = OVERLAP,
    scale: int = SCALE,
    shapes: Collection[Shape] | None = None,
):
    """Encode an image [B, C, H, W] tile by tile as diffusers' `_tiled_encode`.

    encode_tile maps an image tile to whatever latent-size arrays it returns (one array or a
    tuple), each blended linearly. diffusers blends the encoder's moments (mean and log-variance)
    before making the distribution, so a tile function returning a standard deviation should
    hand back its log to match, and the caller exponentiate the result (encode_image does).
    """
    return _tiled(encode_tile, image, tile_sample, tile_sample // scale, overlap, 1, scale, shapes)


def _tiled(fn, x, tile, out_tile, overlap, up, down, shapes):
    height, width = x.shape[-2:]
    blend = int(out_tile * overlap)
    keep = out_tile - blend  # diffusers' row_limit: what is kept of each tile
    if keep * down != int(tile * (1 - overlap)) * up:
        raise ValueError(f"tiles of {tile} overlapping by {overlap} do not tile evenly")
    rows, cols = tile_starts(height, tile, overlap), tile_starts(width, tile, overlap)

    def kept(start: int, size: int) -> int:
        return min(keep, min(tile, size - start) * up // down)

    out_hw = (sum(kept(i, height) for i in rows), sum(kept(j, width) for j in cols))
    outs: list[np.ndarray] = []
    single = True
    above: list[list[np.ndarray]] = []  # the row of tiles above, blended
    y = 0
    for i in rows:
        row: list[list[np.ndarray]] = []
        x0 = 0
        for n, j in enumerate(cols):
            result = _run_tile(fn, x, i, j, tile, up, down, shapes)
            single = isinstance(result, np.ndarray)
            parts = [np.array(r, dtype=np.float32) for r in ([result] if single else result)]
            for k, part in enumerate(parts):
                if above:
                    _blend(above[n][k], part, blend, axis=-2)
                if row:
                    _blend(row[-1][k], part, blend, axis=-1)
            if not outs:
                outs = [np.empty((*p.shape[:-2], *out_hw), np.float32) for p in parts]
            kh, kw = kept(i, height), kept(j, width)
            for out, part in zip(outs, parts, strict=True):
                out[..., y : y + kh, x0 : x0 + kw] = part[..., :kh, :kw]
            x0 += kw
            row.append(parts)
        y += kept(i, height)
        above = row
    return outs[0] if single else tuple(outs)


def _run_tile(fn, x, i, j, tile, up, down, shapes):
    """fn on the tile at (i, j); where fn does not take that tile's shape, on the full-size
    tile moved inward to end at the input's edge (edge-padded where the input is smaller),
    cropped back to the tile's part."""
    height, width = x.shape[-2:]
    part = x[..., i : i + tile, j : j + tile]
    h, w = part.shape[-2:]
    if shapes is None or (h, w) in shapes:
        return fn(np.ascontiguousarray(part))
    if (tile, tile) not in shapes:
        raise ValueError(f"no tile function for {h}x{w} nor for the full {tile}x{tile} tile")
    i0, j0 = max(0, min(i, height - tile)), max(0, min(j, width - tile))
    window = x[..., i0 : i0 + tile, j0 : j0 + tile]
    pad_h, pad_w = tile - window.shape[-2], tile - window.shape[-1]
    if pad_h or pad_w:
        spec = [(0, 0)] * (window.ndim - 2) + [(0, pad_h), (0, pad_w)]
        window = np.pad(window, spec, mode="edge")
    result = fn(np.ascontiguousarray(window))
    top, left = (i - i0) * up // down, (j - j0) * up // down
    oh, ow = h * up // down, w * up // down

    def crop(r):
        return r[..., top : top + oh, left : left + ow]

    return crop(result) if isinstance(result, np.ndarray) else tuple(crop(r) for r in result)


def _blend(a: np.ndarray, b: np.ndarray, extent: int, axis: int) -> None:
    """Fade b's first rows (axis -2) or columns (-1) in over a's last ones, in place in b:
    diffusers' blend_v / blend_h."""
    e = min(a.shape[axis], b.shape[axis], extent)
    if e <= 0:
        return
    ramp = np.arange(e) / e  # y/e in float64, as Python computes it, then the tensor's dtype
    shape = (e, 1) if axis == -2 else (e,)
    w_b = ramp.astype(np.float32).reshape(shape)
    w_a = (1 - ramp).astype(np.float32).reshape(shape)
    if axis == -2:
        b[..., :e, :] = a[..., -e:, :] * w_a + b[..., :e, :] * w_b
    else:
        b[..., :e] = a[..., -e:] * w_a + b[..., :e] * w_b


def decode_bytes(hw_px: Shape, batch: int, itemsize: int) -> int:
    """Estimated working memory of one VAE decode call producing hw_px images (not weights)."""
    return int(DECODE_BYTES_PER_PIXEL * hw_px[0] * hw_px[1] * batch * itemsize // 4)


def encode_bytes(hw_px: Shape, batch: int, itemsize: int) -> int:
    """Estimated working memory of one VAE encode call over hw_px images (not weights)."""
    return int(ENCODE_BYTES_PER_PIXEL * hw_px[0] * hw_px[1] * batch * itemsize // 4)


def needs_tiling(
    latent_hw: Shape,
    module_latent_hw: Shape,
    force: bool | None = None,
    budget_bytes: int | None = None,
    *,
    tile_bytes: int | None = None,
    scale: int = SCALE,
) -> bool:
    """Whether latents of latent_hw go through a VAE module compiled for module_latent_hw in
    tiles. The artifact decides: a module smaller than the latents can only tile (force False
    is refused), one of the latents' own size decodes them whole, as one tile (force True
    changes nothing: diffusers does not tile what fits in a tile either). budget_bytes: the
    memory one call may take; refused when one call (tile_bytes, default decode_bytes of the
    module's size at batch 1 in fp32) needs more."""
    h, w = latent_hw
    mh, mw = module_latent_hw
    px = (h * scale, w * scale)
    tile_px = (mh * scale, mw * scale)
    if mh > h or mw > w:
        raise UserError(
            f"this artifact's VAE takes {tile_px[1]}x{tile_px[0]} px, larger than the "
            f"{px[1]}x{px[0]} image; use the size it was compiled for"
        )
    tiled = (mh, mw) != (h, w)
    if tiled and force is False:
        raise UserError(
            f"--vae-tiling off: this artifact's VAE was compiled for tiles of "
            f"{tile_px[1]}x{tile_px[0]} px and cannot take the {px[1]}x{px[0]} image whole; "
            "leave --vae-tiling out, or recompile with --vae-tile 0"
        )
    need = decode_bytes(tile_px, 1, 4) if tile_bytes is None else tile_bytes
    if budget_bytes is not None and budget_bytes < need:
        what = "one tile" if tiled else "the whole image (compiled untiled)"
        raise UserError(
            f"memory budget {_mib(budget_bytes)} is below the ~{_mib(need)} the VAE needs for "
            f"{what} of {tile_px[1]}x{tile_px[0]} px; raise it, or recompile with a smaller "
            "--vae-tile"
        )
    return tiled


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class VaeCalls:
    """How one VAE module runs over inputs of one size: whole, or in tiles of `tile` (latents
    for the decoder, px for the encoder) through the function of each tile's shape."""

    submodule: str
    tiled: bool
    main: str
    tile: int
    functions: dict[Shape, str]  # input (h, w): entry function
    in_log: tuple[bool, ...] = ()  # per output: blended as its log (a standard deviation)


def module_shapes(manifest, submodule: str) -> dict[Shape, str]:
    """{(h, w) of the input: function name} of a VAE module's entry functions, the main one
    (`decode` / `encode`) first."""
    fns = manifest.submodules[submodule].functions
    main = "decode" if submodule == "vae_decoder" else "encode"
    names = [main] + [f for f in fns if f != main]
    return {tuple(fns[f].inputs[0].shape[-2:]): f for f in names if f in fns}


def plan_vae(
    manifest,
    submodule: str,
    in_hw: Shape,
    *,
    mode: str = "auto",
    budget_bytes: int | None = None,
) -> VaeCalls:
    """Decide, before any work, how submodule takes inputs of in_hw (latents for the decoder,
    px for the encoder) under `--vae-tiling` mode; UserError where it cannot."""
    _check_mode(mode)
    main = "decode" if submodule == "vae_decoder" else "encode"
    decl = manifest.submodules.get(submodule)
    if decl is None:  # a manifest that does not declare it (test fakes): whole, as named
        return VaeCalls(submodule, False, main, max(in_hw), {tuple(in_hw): main})
    functions = module_shapes(manifest, submodule)
    main_hw = next(iter(functions))
    fn = decl.functions[functions[main_hw]]
    # A standard deviation is blended as its log: diffusers blends the log-variance.
    in_log = tuple(o.name.endswith("_std") for o in fn.outputs)
    if tuple(in_hw) != main_hw and tuple(in_hw) in functions:
        # A function of this very size (another of `sdiree compile --sizes`, or an edge tile's
        # shape, which fits in a tile, so diffusers would not tile it either): whole.
        return VaeCalls(submodule, False, functions[tuple(in_hw)], max(in_hw), functions, in_log)
    batch, itemsize = fn.inputs[0].shape[0], np.dtype(fn.inputs[0].dtype).itemsize
    if submodule == "vae_decoder":
        latent_hw, module_hw = tuple(in_hw), main_hw
        call_bytes = decode_bytes((main_hw[0] * SCALE, main_hw[1] * SCALE), batch, itemsize)
    else:
        latent_hw = (in_hw[0] // SCALE, in_hw[1] // SCALE)
        module_hw = (main_hw[0] // SCALE, main_hw[1] // SCALE)
        call_bytes = encode_bytes(main_hw, batch, itemsize)
    force = {"auto": None, "on": True, "off": False}[mode]
    tiled = needs_tiling(latent_hw, module_hw, force, budget_bytes, tile_bytes=call_bytes)
    return VaeCalls(submodule, tiled, functions[main_hw], max(main_hw), functions, in_log)


def check_decode(
    manifest,
    *,
    mode: str = "auto",
    budget_bytes: int | None = None,
    latent_hw: Shape | None = None,
) -> bool:
    """Whether the artifact's images (of latent_hw; default its main size) decode in tiles;
    UserError, before any work, where the mode or budget cannot be met (`sdiree run
    --vae-tiling`)."""
    _check_mode(mode)
    if "vae_decoder" not in manifest.submodules:  # a manifest that does not declare it (fakes)
        return False
    img = manifest.image
    hw = latent_hw or (img["latent_height"], img["latent_width"])
    return plan_vae(manifest, "vae_decoder", hw, mode=mode, budget_bytes=budget_bytes).tiled


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise UserError(f"--vae-tiling {mode}: choose one of {', '.join(MODES)}")


def decode_latents(
    session,
    latents: np.ndarray,
    batch: int,
    dtype,
    *,
    manifest=None,
    mode: str = "auto",
    budget_bytes: int | None = None,
) -> np.ndarray:
    """Images [N, 3, H, W] float32 in [-1, 1] from latents [N, 4, h, w], in chunks of the
    compiled batch, whole or in tiles as the artifact's VAE decoder allows (mode: auto, on
    or off, `sdiree run --vae-tiling`). manifest: the session's, unless given."""
    manifest = manifest or session.manifest
    calls = plan_vae(
        manifest, "vae_decoder", latents.shape[-2:], mode=mode, budget_bytes=budget_bytes
    )
    return run_vae(session, calls, latents, batch, dtype)


def encode_image(
    session,
    image: np.ndarray,
    batch: int,
    dtype,
    *,
    manifest=None,
    mode: str = "auto",
    budget_bytes: int | None = None,
) -> np.ndarray | tuple:
    """The encoder's outputs for images [N, 3, H, W] in [-1, 1] (latent mean, and std where
    the module returns it: a tuple then), as decode_latents does for the decoder."""
    manifest = manifest or session.manifest
    calls = plan_vae(
        manifest, "vae_encoder", image.shape[-2:], mode=mode, budget_bytes=budget_bytes
    )
    return run_vae(session, calls, image, batch, dtype)


def run_vae(session, calls: VaeCalls, x: np.ndarray, batch: int, dtype):
    """calls' module over x in chunks of the compiled batch (the last one padded)."""
    submodule, in_log = calls.submodule, calls.in_log

    first = [True]

    def call(tile: np.ndarray):
        name = calls.functions[tuple(tile.shape[-2:])] if calls.tiled else calls.main
        outs = session.call(submodule, name, tile.astype(dtype))
        if calls.tiled and first[0]:
            first[0] = False
            # Freed heap stays resident on the cpu driver (runtime/host_memory.py), and a
            # module's first call leaves allocations of its own above its freed work buffers:
            # the second call then took fresh memory while the first's stayed, ~2 GB more at
            # SD 1.5's 512 px tile (a 1024x1024 tiled decode peaked at 4.8 GB against 2.8 GB
            # for 512x512). Released after the first tile, the second call refaults what it
            # needs (~1 s) and later calls reuse it.
            release_freed_heap()
        if calls.tiled and any(in_log):
            outs = [
                np.log(o.astype(np.float32)) if log else o
                for o, log in zip(outs, in_log, strict=True)
            ]
        return outs[0] if len(outs) == 1 else tuple(outs)

    tiler, size = (
        (decode_tiled, "tile_latent")
        if submodule == "vae_decoder"
        else (encode_tiled, "tile_sample")
    )
    results = []
    for start in range(0, x.shape[0], batch):
        part = x[start : start + batch]
        n = part.shape[0]
        if n < batch:
            part = np.concatenate([part, np.zeros((batch - n, *part.shape[1:]), part.dtype)])
        if calls.tiled:
            out = tiler(call, part, **{size: calls.tile}, shapes=calls.functions)
        else:
            out = call(part)
        outs = [out] if isinstance(out, np.ndarray) else list(out)
        if calls.tiled and any(in_log):
            outs = [np.exp(o) if log else o for o, log in zip(outs, in_log, strict=True)]
        results.append([o[:n].astype(np.float32) for o in outs])
    merged = [np.concatenate(parts) for parts in zip(*results, strict=True)]
    return merged[0] if len(merged) == 1 else tuple(merged)
