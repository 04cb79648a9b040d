"""`sdiree run --weights` on an SDXL artifact: a tiny SDXL "fine-tune" (every tensor of all four
components moved a little) as an SGM single file gives the image of the same weights read from
its diffusers folder, and diffusers' image of that folder; an SD 1.x file is refused."""

from __future__ import annotations

import pytest

from sdiree.runtime.errors import UserError

pytest.importorskip("torch")
from parity import diffusers_images, psnr  # noqa: E402  (tools/, on sys.path via conftest)
from test_weight_files import _moved as moved  # noqa: E402  (this folder)
from test_weight_files import _run as run_image  # noqa: E402
from to_single_file import write_single_file  # noqa: E402

PROMPT, NEGATIVE = "a lighthouse on a cliff", "blurry"
SEED, STEPS, GUIDANCE = 7, 6, 7.5
COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")


@pytest.fixture(scope="module")
def fine_tune(tiny_sdxl_model, tmp_path_factory):
    return moved(tiny_sdxl_model, tmp_path_factory.mktemp("xl-ft") / "tiny-sdxl-ft", 1, COMPONENTS)


def _run(art, out, **kw):
    return run_image(
        art, out, prompt=PROMPT, negative_prompt=NEGATIVE, steps=STEPS, guidance_scale=GUIDANCE,
        seed=SEED, **kw,
    )  # fmt: skip


def test_sdxl_weights_file_is_the_fine_tune(compiled_sdxl, fine_tune, tiny_model, tmp_path):
    art = compiled_sdxl.get("cpu", "host", "fp32")
    single = write_single_file(fine_tune, tmp_path / "tiny-sdxl-ft.safetensors", fp16=False)
    from_file, params = _run(art, tmp_path / "f.png", weights=single)
    from_folder, _ = _run(art, tmp_path / "d.png", weights=fine_tune)
    base, _ = _run(art, tmp_path / "b.png")
    assert psnr(from_file, from_folder) >= 60.0
    ref = diffusers_images(
        fine_tune, "euler", STEPS, GUIDANCE, SEED, PROMPT, NEGATIVE, 1, (64, 64)
    )[0]
    print(
        f"SDXL --weights: file vs folder {psnr(from_file, from_folder):.1f} dB, vs diffusers "
        f"{psnr(from_file, ref):.1f} dB, base vs diffusers {psnr(base, ref):.1f} dB"
    )
    assert psnr(from_file, ref) >= 40.0
    assert psnr(base, ref) < 35.0  # the fine-tune is not the model itself
    assert "Model: tiny-sdxl-ft," in params
    # an SD 1.x file on the SDXL artifact: one line, nothing written
    sd1 = write_single_file(tiny_model, tmp_path / "tiny-sd1.safetensors")
    with pytest.raises(UserError, match="is an SD 1.x checkpoint, but this artifact was compiled"):
        _run(art, tmp_path / "x.png", weights=sd1)
    assert not (tmp_path / "x.png").exists()
