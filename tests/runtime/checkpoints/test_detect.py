"""Detection of a single file's model from its keys and shapes, and the one-line refusals of
everything sdiree does not take (zero-memory stand-in tensors: only keys and shapes matter)."""

from __future__ import annotations

import numpy as np
import pytest

from sdiree.runtime.checkpoints.detect import check_shapes, detect
from sdiree.runtime.errors import UserError

U = "model.diffusion_model."


def z(*shape) -> np.ndarray:
    return np.broadcast_to(np.float16(0), shape)


def ldm(family="sd1", in_channels=4, dim=None, text=None, linear=None) -> dict:
    """The keys detection reads, SD 1.x (CLIP, conv projections) or SD 2.x (OpenCLIP, linear)."""
    sd2 = family == "sd2"
    dim = dim or (1024 if sd2 else 768)
    linear = sd2 if linear is None else linear
    text = text or ("open_clip" if sd2 else "clip")
    keys = {
        U + "input_blocks.0.0.weight": z(320, in_channels, 3, 3),
        U + "input_blocks.1.1.proj_in.weight": z(320, 320) if linear else z(320, 320, 1, 1),
        U + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": z(320, dim),
        "first_stage_model.encoder.conv_in.weight": z(128, 3, 3, 3),
    }
    if text == "clip":
        keys["cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"] = z(
            49408, 768
        )
    else:
        keys["cond_stage_model.model.token_embedding.weight"] = z(49408, 1024)
    return keys


def refusal(tensors, *must_say) -> str:
    with pytest.raises(UserError) as e:
        detect(tensors, where="model.safetensors")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.safetensors"), msg
    for s in must_say:
        assert s in msg, msg
    return msg


def test_sd1():
    d = detect(ldm("sd1"))
    assert (d.family, d.preset, d.prediction_type, d.inpainting) == (
        "sd1",
        "sd15",
        "epsilon",
        False,
    )
    assert d.context_dim == 768 and d.text_encoder == "clip" and not d.has_ema


def test_sd1_inpainting():
    d = detect(ldm("sd1", in_channels=9))
    assert (d.family, d.preset, d.inpainting, d.in_channels) == ("sd1", "sd15-inpainting", True, 9)


def test_sd2_prediction_type_default_global_step_and_override():
    d = detect(ldm("sd2"))
    assert (d.family, d.preset, d.prediction_type) == ("sd2", "sd21", "v_prediction")
    base = detect(ldm("sd2"), extras={"global_step": 875000})
    assert (base.preset, base.prediction_type) == ("sd21-base", "epsilon")
    asked = detect(ldm("sd2"), prediction_type="epsilon")
    assert (asked.preset, asked.prediction_source) == ("sd21-base", "--prediction-type")
    v = detect(ldm("sd2"), extras={"global_step": 875000}, prediction_type="v_prediction")
    assert v.preset == "sd21"
    inpaint = detect(ldm("sd2", in_channels=9))
    assert (inpaint.preset, inpaint.prediction_type) == ("sd2-inpainting", "epsilon")
    sd1_v = detect(ldm("sd1"), prediction_type="v_prediction")
    assert (sd1_v.preset, sd1_v.prediction_type) == ("sd15", "v_prediction")


def test_ema_weights_noticed():
    keys = ldm("sd1")
    keys["model_ema.diffusion_modelinput_blocks00weight"] = z(320, 4, 3, 3)
    assert detect(keys).has_ema


def sdxl_keys() -> dict:
    """The keys detection reads in SDXL base 1.0 (SGM layout), at their real shapes."""
    keys = {
        "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight": z(
            49408, 768
        ),
        "conditioner.embedders.1.model.token_embedding.weight": z(49408, 1280),
        U + "label_emb.0.0.weight": z(1280, 2816),
        U + "input_blocks.0.0.weight": z(320, 4, 3, 3),
        U + "input_blocks.4.1.proj_in.weight": z(640, 640),
        U + "input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight": z(640, 2048),
        "first_stage_model.encoder.conv_in.weight": z(128, 3, 3, 3),
    }
    return keys


def test_sdxl_base_detected():
    det = detect(sdxl_keys())
    assert (det.family, det.preset, det.label) == ("sdxl", "sdxl", "SDXL")
    assert det.text_encoder == "clip+open_clip" and det.context_dim == 2048
    assert (det.prediction_type, det.inpainting) == ("epsilon", False)
    vpred = detect({**sdxl_keys(), "v_pred": z(1)})
    assert vpred.prediction_type == "v_prediction" and "v_pred" in vpred.prediction_source
    assert detect(sdxl_keys(), prediction_type="sample").prediction_type == "sample"


def test_sdxl_refiner_and_partial_files_refused_naming_what_they_hold():
    keys = sdxl_keys()
    del keys["conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight"]
    del keys["conditioner.embedders.1.model.token_embedding.weight"]
    keys["conditioner.embedders.0.model.token_embedding.weight"] = z(49408, 1280)
    keys[U + "input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight"] = z(768, 1280)
    refusal(keys, "SDXL refiner", "conditioner.embedders.0.model.*", "no CLIP ViT-L")
    only_g = sdxl_keys()
    del only_g["conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight"]
    refusal(only_g, "but conditioner.embedders.1.model.*;", "an SDXL base checkpoint holds CLIP")
    inpaint = {**sdxl_keys(), U + "input_blocks.0.0.weight": z(320, 9, 3, 3)}
    refusal(inpaint, "SDXL inpainting model (9-channel UNet)")
    wrong = {
        **sdxl_keys(),
        U + "input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight": z(640, 2304),
    }
    refusal(wrong, "cross-attention width 2304", "(768 + 1280)")
    refusal({**sdxl_keys(), "edm_mean": z(1, 4, 1, 1), "edm_std": z(1, 4, 1, 1)}, "Playground")


@pytest.mark.parametrize(
    "key,say",
    [
        (U + "joint_blocks.0.context_block.adaLN_modulation.1.bias", "Stable Diffusion 3"),
        (U + "double_blocks.0.img_attn.norm.key_norm.scale", "Flux"),
        ("control_model.time_embed.0.weight", "ControlNet"),
    ],
)
def test_other_families_refused(key, say):
    keys = ldm("sd1")
    keys[key] = z(4)
    refusal(keys, say)


@pytest.mark.parametrize(
    "channels,say", [(5, "depth-to-image"), (7, "upscaler"), (8, "InstructPix2Pix"), (6, "6 input")]
)
def test_other_unet_inputs_refused(channels, say):
    refusal(ldm("sd1", in_channels=channels), say)


@pytest.mark.parametrize(
    "keys,say",
    [
        ({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": z(4, 320)}, "is a LoRA"),
        ({"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": z(4, 320)}, "is a LoRA"),
        ({"string_to_param.*": z(1, 768)}, "textual-inversion embedding"),
        ({"clip_l": z(2, 768), "clip_g": z(2, 1280)}, "textual-inversion embedding"),
        (
            {"encoder.conv_in.weight": z(128, 3, 3, 3), "decoder.conv_in.weight": z(1)},
            "a VAE on its own",
        ),
        ({"down_blocks.0.resnets.0.conv1.weight": z(320, 320, 3, 3)}, "diffusers-layout"),
        ({"foo": z(1)}, "holds no Stable Diffusion UNet"),
        ({}, "holds no tensors"),
    ],
    ids=[
        "kohya-lora",
        "peft-lora",
        "embedding",
        "sdxl-embedding",
        "vae",
        "diffusers",
        "other",
        "empty",
    ],
)
def test_files_that_are_not_whole_models(keys, say):
    refusal(keys, say)


def test_missing_parts():
    keys = ldm("sd1")
    del keys["first_stage_model.encoder.conv_in.weight"]
    refusal(keys, "has no VAE")
    keys = ldm("sd1")
    del keys["cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"]
    refusal(keys, "has no text encoder")
    keys = ldm("sd1")
    del keys[U + "input_blocks.0.0.weight"]
    refusal(keys, "has no UNet input convolution")


def test_mixed_families_and_widths():
    refusal(ldm("sd1", linear=True), "mixes model families", "SD 2.x (linear projections)")
    refusal(ldm("sd2", linear=False), "mixes model families", "SD 1.x (convolution projections)")
    refusal(ldm("sd1", dim=1024), "cross-attention width 1024", "hidden size 768")


def test_unknown_prediction_type():
    with pytest.raises(UserError, match="--prediction-type 'x'"):
        detect(ldm("sd1"), prediction_type="x")


def test_check_shapes_names_the_first_difference():
    expected = {"a.weight": (2, 3), "b.weight": (4,)}
    check_shapes(expected, {"a.weight": z(2, 3), "b.weight": z(4)}, "f", "unet", "cfg")
    with pytest.raises(UserError) as e:
        check_shapes(expected, {"a.weight": z(3, 3), "b.weight": z(4)}, "f", "unet", "cfg")
    assert "unet tensor a.weight has shape [3, 3], but cfg expects [2, 3]" in str(e.value)
    with pytest.raises(UserError, match="has no tensor b.weight"):
        check_shapes(expected, {"a.weight": z(2, 3)}, "f", "unet", "cfg")
    with pytest.raises(UserError, match=r"tensor c.weight \(and 1 more\) has no place in cfg"):
        check_shapes(
            expected,
            {"a.weight": z(2, 3), "b.weight": z(4), "c.weight": z(1), "d.weight": z(1)},
            "f",
            "unet",
            "cfg",
        )
