"""Tiled VAE decode and encode: the numpy tiler against diffusers' enable_tiling on the tiny
model's VAE, through torch per tile and through an artifact compiled at the tile size; the
compile plan's tile shapes; and the bad input (`--vae-tile`, budgets, `--vae-tiling off`)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdiree.runtime.errors import UserError
from sdiree.runtime.image_output import to_uint8
from sdiree.runtime.vae_tiling import (
    check_decode,
    check_tile,
    decode_latents,
    decode_tiled,
    encode_image,
    encode_tiled,
    needs_tiling,
    tile_shapes,
    tile_starts,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))
from compile_queue import Queued  # noqa: E402
from parity import psnr  # noqa: E402

TILE = 8  # the tiny VAE's sample_size 64 px, in latents: diffusers' tile_latent_min_size
SIZES = [(16, 16), (20, 28), (13, 17), (8, 20)]


def psnr8(a: np.ndarray, b: np.ndarray) -> float:
    return psnr(to_uint8(a), to_uint8(b))


@pytest.fixture(scope="module")
def vae(tiny_model):
    pytest.importorskip("torch")
    from diffusers import AutoencoderKL

    model = AutoencoderKL.from_pretrained(tiny_model / "vae").eval().requires_grad_(False)
    assert model.tile_latent_min_size == TILE and model.tile_overlap_factor == 0.25
    return model


def torch_decode(vae, tiled: bool):
    import torch

    def decode(z: np.ndarray) -> np.ndarray:
        vae.enable_tiling() if tiled else vae.disable_tiling()
        return vae.decode(torch.from_numpy(z)).sample.numpy()

    return decode


def latents(hw, batch=2, seed=1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 4, *hw)).astype(np.float32)


@pytest.mark.parametrize("hw", SIZES)
def test_tiled_decode_is_diffusers(vae, hw):
    """Run per tile by the torch VAE (any shape), the tiler gives diffusers' tiled decode."""
    z = latents(hw)
    ref = torch_decode(vae, tiled=True)(z)
    ours = decode_tiled(torch_decode(vae, tiled=False), z, tile_latent=TILE)
    assert ours.shape == ref.shape == (2, 3, hw[0] * 8, hw[1] * 8)
    assert np.abs(ours - ref).max() <= 1e-5
    assert psnr8(ours, ref) >= 40.0
    if hw == SIZES[0]:  # tiling matters: the whole-image decode is far from the tiled one
        assert psnr8(torch_decode(vae, tiled=False)(z), ref) < 30.0


@pytest.mark.parametrize("hw", [(16, 16), (13, 17)])
def test_tiled_encode_is_diffusers(vae, hw):
    """The encoder's moments are blended as diffusers does, the std as its log."""
    import torch

    x = np.random.default_rng(2).uniform(-1, 1, (1, 3, hw[0] * 8, hw[1] * 8)).astype(np.float32)
    vae.enable_tiling()
    ref = vae.encode(torch.from_numpy(x)).latent_dist
    vae.disable_tiling()

    def encode(tile):
        dist = vae.encode(torch.from_numpy(tile)).latent_dist
        return dist.mean.numpy(), np.log(dist.std.numpy())

    mean, log_std = encode_tiled(encode, x, tile_sample=TILE * 8)
    np.testing.assert_allclose(mean, ref.mean.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.exp(log_std), ref.std.numpy(), rtol=1e-5)


def test_edge_tiles_from_full_tiles_differ_at_the_edges_only(vae):
    """Without functions for the short edge tiles, full tiles moved inward stand in: what no
    edge tile reaches is still diffusers', the edges are not (why compile adds the shapes)."""
    z = latents((16, 16))
    ref = torch_decode(vae, tiled=True)(z)
    calls = []

    def decode(tile):
        calls.append(tile.shape[-2:])
        return torch_decode(vae, tiled=False)(tile)

    ours = decode_tiled(decode, z, tile_latent=TILE, shapes={(TILE, TILE)})
    assert ours.shape == ref.shape and set(calls) == {(TILE, TILE)} and len(calls) == 9
    # tiles start at 0, 6, 12 latents; the short one at 12 touches only the image from 96 px
    np.testing.assert_allclose(ours[..., :96, :96], ref[..., :96, :96], atol=1e-5)
    assert psnr8(ours, ref) < 40.0


def test_tile_shapes_are_those_diffusers_makes():
    for hw in SIZES + [(24, 24), (9, 9), (8, 8), (5, 7), (64, 64), (128, 96)]:
        t = 64 if max(hw) >= 64 else TILE
        seen = {
            (min(t, hw[0] - i), min(t, hw[1] - j))
            for i in tile_starts(hw[0], t)
            for j in tile_starts(hw[1], t)
        }
        shapes = tile_shapes(hw, t)
        assert shapes[0] == (min(t, hw[0]), min(t, hw[1]))
        assert set(shapes) == (seen if max(hw) > t else {hw}), hw
    assert tile_shapes((128, 128), 64) == [(64, 64), (64, 32), (32, 64), (32, 32)]
    assert tile_shapes((256, 256), 64) == [(64, 64), (64, 16), (16, 64), (16, 16)]


def test_needs_tiling():
    assert needs_tiling((64, 64), (64, 64)) is False
    assert needs_tiling((64, 64), (64, 64), force=True) is False  # one tile: as diffusers
    assert needs_tiling((128, 256), (64, 64)) is True
    assert needs_tiling((128, 256), (64, 64), force=True, budget_bytes=2**40) is True
    with pytest.raises(UserError, match="--vae-tiling off") as e:
        needs_tiling((128, 128), (64, 64), force=False)
    assert "\n" not in str(e.value) and "--vae-tile 0" in str(e.value)
    with pytest.raises(UserError, match="below") as e:
        needs_tiling((128, 128), (64, 64), budget_bytes=100 * 2**20)
    assert "\n" not in str(e.value) and "512x512 px" in str(e.value)
    with pytest.raises(UserError, match="larger than"):
        needs_tiling((32, 32), (64, 64))


@pytest.mark.parametrize("px", [100, 48, -32, 8])
def test_check_tile_refuses_sides_that_do_not_tile(px):
    with pytest.raises(UserError, match=f"--vae-tile {px} is not a positive multiple of 32"):
        check_tile(px)


def test_compile_refuses_a_bad_vae_tile(tiny_model, tmp_path):
    px, out = "100", tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "compile", str(tiny_model),
         "--target", "cpu", "--height", "128", "--width", "128", "--vae-tile", px,
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: --vae-tile {px} "), proc.stderr
    assert not out.exists()


def test_plan_compiles_the_vae_at_its_tile_shapes(tiny_model, tmp_path):
    from sdiree.compile.plan import CompileOptions, resolve
    from sdiree.compile.report import Reporter

    def plan(**kw):
        opts = CompileOptions(tiny_model, "cpu", out=tmp_path / "o", **kw)
        return resolve(opts, Reporter(stream=io.StringIO()))

    assert plan().vae_image_shapes() == [(64, 64)]  # the model's own size: one tile
    tiled = plan(height=128, width=192)
    assert tiled.vae_tile == 64 and tiled.vae_tiled
    assert tiled.vae_image_shapes() == [(64, 64), (64, 48), (32, 64), (32, 48)]
    assert plan(height=128, width=128, vae_tile=0).vae_image_shapes() == [(128, 128)]
    assert plan(height=128, width=128, vae_tile=128).vae_image_shapes() == [(128, 128)]
    assert plan(height=128, width=128, vae_tile=96).vae_image_shapes()[0] == (96, 96)


def _tiled_options(root: Path, model: Path) -> dict:
    """The tiny model's VAE compiled for cpu at 128x128 (twice its sample_size): its modules
    take 64 px tiles and the 32 px edge tiles. Its convolutions are plain im2col matmuls (a
    specs copy), not the preset's Winograd F(4x4): tiling does not depend on how a conv is
    lowered, the preset's VAE is compiled for every other cpu test (a non-square size by
    test_compile_sizes), and the eight Winograd functions took this compile 171 s against 88 s
    (Zen 5, quiet; ~550 s in a loaded CI)."""
    import json
    import shutil

    specs = root / "specs"
    shutil.copytree(ROOT / "specs", specs)
    registry = json.loads((specs / "targets.json").read_text())
    for sub in ("vae_decoder", "vae_encoder"):
        registry["targets"]["cpu"]["submodule_export"][sub] = {"conv": "matmul"}
    (specs / "targets.json").write_text(json.dumps(registry))
    return dict(
        model_dir=model, target="cpu", height=128, width=128, out=root / "cpu-128",
        specs_dir=specs, submodules=("vae_decoder", "vae_encoder"),
    )  # fmt: skip


TILED = Queued("vae-tiled-cpu-128", _tiled_options)  # compiled in the background


@pytest.fixture(scope="module")
def tiled_session(tiny_model, tmp_path_factory):
    """A session on TILED's artifact."""
    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.session import Session

    root, _ = TILED.result(tiny_model, tmp_path_factory)
    manifest = load_manifest(root / "cpu-128")
    info, _ = choose_device(manifest, None)
    return Session(manifest, info, ("vae_decoder", "vae_encoder"))


def test_compiled_tiles_decode_as_diffusers(tiled_session, vae):
    import torch

    fns = tiled_session.manifest.submodules["vae_decoder"].functions
    assert {f: d.inputs[0].shape[-2:] for f, d in fns.items()} == {
        "decode": (8, 8), "decode_8x4": (8, 4), "decode_4x8": (4, 8), "decode_4x4": (4, 4),
    }  # fmt: skip
    z = latents((16, 16), batch=3, seed=5)  # 3 images through the batch-1 module
    images = decode_latents(tiled_session, z, 1, np.float32)
    vae.enable_tiling()
    ref = vae.decode(torch.from_numpy(z) / vae.config.scaling_factor).sample.numpy()
    assert images.shape == ref.shape == (3, 3, 128, 128)
    assert psnr8(images, ref) >= 40.0


def test_compiled_tiles_encode_as_diffusers(tiled_session, vae):
    import torch

    x = np.random.default_rng(6).uniform(-1, 1, (2, 3, 128, 128)).astype(np.float32)
    outs = encode_image(tiled_session, x, 1, np.float32)
    outs = outs if isinstance(outs, tuple) else (outs,)
    vae.enable_tiling()
    dist = vae.encode(torch.from_numpy(x)).latent_dist
    sf = vae.config.scaling_factor
    np.testing.assert_allclose(outs[0], dist.mean.numpy() * sf, atol=1e-5)
    if len(outs) > 1:  # the encoder returns the std too
        np.testing.assert_allclose(outs[1], dist.std.numpy() * sf, rtol=1e-4)


def test_run_side_bad_input(tiled_session):
    manifest = tiled_session.manifest
    assert check_decode(manifest) is True and check_decode(manifest, mode="on") is True
    with pytest.raises(UserError, match="--vae-tiling off: this artifact's VAE was compiled"):
        check_decode(manifest, mode="off")  # before any work: from the manifest alone
    z = latents((16, 16), batch=1)
    with pytest.raises(UserError, match="--vae-tiling off"):
        decode_latents(tiled_session, z, 1, np.float32, mode="off")
    with pytest.raises(UserError, match="--vae-tiling sometimes: choose one of auto, on, off"):
        decode_latents(tiled_session, z, 1, np.float32, mode="sometimes")
    with pytest.raises(UserError, match="memory budget 1 MiB is below"):
        decode_latents(tiled_session, z, 1, np.float32, budget_bytes=2**20)
