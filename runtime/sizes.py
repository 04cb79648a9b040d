"""The image sizes an artifact runs at, and the entry functions that run each.

`sdiree compile` builds an artifact for one image size (`--height/--width`) and, with `--sizes`,
for more: each extra size gets its own UNet functions (`denoise_cfg_<h>x<w>`/`denoise_<h>x<w>`,
named for their latents) and VAE functions, all sharing one set of parameters, so one artifact
serves several sizes at the speed of a single-size one. (Dynamic shapes were measured and
rejected: compile/NOTES.md, "Image sizes".) The manifest lists the sizes (`image.sizes`, main
first); the runtime checks a request against them and finds a size's functions by the input
shapes the manifest records.
"""

from __future__ import annotations

from .errors import UserError

Size = tuple[int, int]  # (height, width) in px
VAE_SCALE = 8  # image px per latent of SD's VAEs, where an older manifest does not say


def parse_sizes(text: str) -> tuple[Size, ...]:
    """`512x768,768x512` (width x height, as image sizes are written) as ((h, w), ...)."""
    sizes = []
    for item in (t.strip() for t in text.split(",")):
        w, sep, h = item.lower().partition("x")
        if not (sep and w.isdigit() and h.isdigit()):
            raise UserError(
                f"--sizes {text}: {item!r} is not WIDTHxHEIGHT; write e.g. 512x768,768x512"
            )
        sizes.append((int(h), int(w)))
    return tuple(sizes)


def compiled_sizes(manifest) -> list[Size]:
    """The sizes (px) manifest's artifact runs at, the main one first."""
    img = manifest.image
    listed = img.get("sizes") or [{"height": img["height"], "width": img["width"]}]
    try:
        return [(int(s["height"]), int(s["width"])) for s in listed]
    except (TypeError, KeyError, ValueError):
        raise UserError(
            f"{manifest.root}: its manifest's image.sizes is not a list of heights and widths; "
            "recompile it, or copy the whole artifact directory"
        ) from None


def _written(sizes: list[Size]) -> str:
    return ", ".join(f"{w}x{h}" for h, w in sizes)


def resolve_size(manifest, width: int | None, height: int | None) -> Size:
    """The size (px) a request runs at: the one asked for (either side alone picks the compiled
    size that has it), or the main size; UserError when the artifact has none such."""
    sizes = compiled_sizes(manifest)
    for label, v in (("width", width), ("height", height)):
        if v is not None and (v <= 0 or v % 8):
            raise UserError(f"--{label} {v} is not a positive multiple of 8; leave it out")
    if width is None and height is None:
        return sizes[0]
    fits = [
        (h, w)
        for h, w in sizes
        if (width is None or w == width) and (height is None or h == height)
    ]
    if not fits:
        wanted = f"{width or sizes[0][1]}x{height or sizes[0][0]}"
        raise UserError(
            f"{wanted} px: this artifact was compiled for {_written(sizes)}; recompile with "
            f"--sizes {wanted} (one artifact takes several) or pick one of those"
        )
    return fits[0]


def latent_size(manifest, size: Size) -> Size:
    """The latents' (h, w) of an image of size (px)."""
    img = manifest.image
    factor = img.get("vae_scale_factor") or (
        img["height"] // img["latent_height"] if "latent_height" in img else VAE_SCALE
    )
    return size[0] // factor, size[1] // factor


def unet_function(manifest, latent_hw: Size, guided: bool) -> str:
    """The UNet entry function for latents of latent_hw, guided (`denoise_cfg`) or not."""
    base = "denoise_cfg" if guided else "denoise"
    functions = manifest.submodules["unet"].functions
    h, w = latent_hw
    for name in (base, f"{base}_{h}x{w}"):
        fn = functions.get(name)
        if fn is not None and tuple(fn.inputs[0].shape[-2:]) == (h, w):
            return name
    raise UserError(
        f"{manifest.root}: its UNet has no function for {h}x{w} latents; the manifest "
        f"lists sizes its modules lack: recompile it with `sdiree compile`"
    )
