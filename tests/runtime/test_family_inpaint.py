"""Inpainting folders in the family registry: an SD 1.x or 2.x folder whose UNet takes 9 input
channels (latents, mask, masked-image latents) is of its family and runs the "inpaint" pipeline;
a 4-channel one runs "text2img" (which also does img2img and latent-blending inpainting), and a
UNet of another input width is refused naming it (torch-free)."""

from __future__ import annotations

import json

import pytest

from sdiree.runtime.errors import UserError
from sdiree.runtime.families import PIPELINES, default_path, load_families

INDEX = {
    "_class_name": "StableDiffusionInpaintPipeline",
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "scheduler": ["diffusers", "PNDMScheduler"],
}
SD1_TE = {"hidden_act": "quick_gelu", "hidden_size": 768}
SD2_TE = {"hidden_act": "gelu", "hidden_size": 1024}
SD1_UNET = {"cross_attention_dim": 768}
SD2_UNET = {"cross_attention_dim": 1024, "use_linear_projection": True}


def family_and_pipeline(cls: str, unet: dict, te: dict) -> tuple[str, str]:
    reg = load_families()
    configs = {"unet": unet, "text_encoder": te}
    fam = reg.detect({**INDEX, "_class_name": cls}, configs, "/m")
    return fam.name, reg.pipeline_for(fam, configs)


@pytest.mark.parametrize(
    "cls",
    ["StableDiffusionInpaintPipeline", "StableDiffusionPipeline", "SomeoneElsesPipeline"],
)
def test_a_9_channel_unet_runs_the_inpaint_pipeline(cls):
    assert family_and_pipeline(cls, {**SD1_UNET, "in_channels": 9}, SD1_TE) == ("sd1", "inpaint")
    assert family_and_pipeline(cls, {**SD2_UNET, "in_channels": 9}, SD2_TE) == ("sd2", "inpaint")


def test_a_4_channel_unet_runs_text2img_whatever_the_class():
    for cls in ("StableDiffusionInpaintPipeline", "StableDiffusionPipeline"):
        assert family_and_pipeline(cls, {**SD1_UNET, "in_channels": 4}, SD1_TE) == (
            "sd1",
            "text2img",
        )
    # in_channels left out: diffusers' default, 4
    assert family_and_pipeline("StableDiffusionPipeline", SD1_UNET, SD1_TE)[1] == "text2img"
    assert "inpaint" in PIPELINES and "text2img" in PIPELINES


def test_other_input_widths_are_refused_naming_it():
    with pytest.raises(UserError) as info:
        family_and_pipeline("MyPix2PixPipeline", {**SD1_UNET, "in_channels": 8}, SD1_TE)
    msg = str(info.value)
    assert "in_channels 8" in msg and "no model family sdiree knows" in msg and "\n" not in msg
    with pytest.raises(UserError, match="a depth-to-image model"):
        family_and_pipeline("StableDiffusionDepth2ImgPipeline", SD2_UNET, SD2_TE)


def test_a_variant_naming_an_unknown_pipeline_is_refused(tmp_path):
    data = json.loads(default_path().read_text())
    data["families"]["sd1"]["pipeline_variants"] = {"outpaint": {"unet": {"in_channels": [9]}}}
    path = tmp_path / "families.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="families.sd1.pipeline_variants names no pipeline"):
        load_families(path)
