"""runtime/sizes.py: parsing --sizes, checking a request's size against an artifact's, and
finding the UNet function of a size (a manifest made by hand; the compiled path is
tests/compile/test_compile_sizes.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from sdiree.runtime.errors import UserError
from sdiree.runtime.manifest import FunctionDecl, SubmoduleDecl, TensorDecl
from sdiree.runtime.sizes import (
    compiled_sizes,
    latent_size,
    parse_sizes,
    resolve_size,
    unet_function,
)


def fake_manifest(sizes=None):
    """An artifact compiled at 512x512 (latents 64x64) and, with sizes, at those too."""
    image = {"height": 512, "width": 512, "latent_height": 64, "latent_width": 64}
    functions = {}
    for i, (h, w) in enumerate([(512, 512), *(sizes or [])]):
        lh, lw = h // 8, w // 8
        for base, batch in (("denoise_cfg", 2), ("denoise", 1)):
            name = base if i == 0 else f"{base}_{lh}x{lw}"
            sample = TensorDecl("sample", (1, 4, lh, lw), "float32")
            text = TensorDecl("encoder_hidden_states", (batch, 77, 768), "float32")
            functions[name] = FunctionDecl(name, (sample, text), (sample,))
    if sizes:
        image["sizes"] = [{"height": h, "width": w} for h, w in [(512, 512), *sizes]]
    unet = SubmoduleDecl("unet", "unet.vmfb", None, None, functions)
    return SimpleNamespace(image=image, submodules={"unet": unet}, root=Path("/art"))


def test_parse_sizes():
    assert parse_sizes("512x768") == ((768, 512),)
    assert parse_sizes("512x768, 768X512") == ((768, 512), (512, 768))
    for bad in ("512", "512x", "x512", "512x768;640x640", "a x b", "-8x64"):
        with pytest.raises(UserError, match="is not WIDTHxHEIGHT"):
            parse_sizes(bad)


def test_a_single_size_artifact():
    m = fake_manifest()
    assert compiled_sizes(m) == [(512, 512)]
    assert resolve_size(m, None, None) == (512, 512)
    assert resolve_size(m, 512, 512) == (512, 512)
    with pytest.raises(UserError, match=r"compiled for 512x512; recompile with --sizes 768x512"):
        resolve_size(m, 768, None)
    assert unet_function(m, (64, 64), guided=True) == "denoise_cfg"
    assert unet_function(m, (64, 64), guided=False) == "denoise"


def test_several_sizes():
    m = fake_manifest([(768, 512), (512, 768)])
    assert compiled_sizes(m) == [(512, 512), (768, 512), (512, 768)]
    assert resolve_size(m, 512, 768) == (768, 512)
    assert resolve_size(m, 768, None) == (512, 768)  # the one compiled size with that width
    assert resolve_size(m, None, 768) == (768, 512)
    assert latent_size(m, (768, 512)) == (96, 64)
    assert unet_function(m, (96, 64), guided=True) == "denoise_cfg_96x64"
    assert unet_function(m, (64, 96), guided=False) == "denoise_64x96"
    with pytest.raises(UserError, match=r"512x512, 512x768, 768x512"):
        resolve_size(m, 640, 640)
    for bad in (0, -64, 500):
        with pytest.raises(UserError, match="not a positive multiple of 8"):
            resolve_size(m, bad, None)


def test_a_manifest_listing_a_size_its_unet_lacks_is_refused():
    m = fake_manifest([(768, 512)])
    m.image["sizes"].append({"height": 640, "width": 640})
    assert resolve_size(m, 640, 640) == (640, 640)
    with pytest.raises(UserError, match="no function for 80x80 latents"):
        unet_function(m, (80, 80), guided=True)
    m.image["sizes"] = [{"height": "tall"}]
    with pytest.raises(UserError, match="image.sizes is not a list"):
        compiled_sizes(m)
