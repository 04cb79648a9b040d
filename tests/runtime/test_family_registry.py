"""runtime/families: specs/families.json is read and checked, and `detect` names a folder's
family from its model_index.json and configs, or refuses it in one line (torch-free)."""

from __future__ import annotations

import json

import pytest

from sdiree.runtime.errors import UserError
from sdiree.runtime.families import PIPELINES, default_path, load_families
from sdiree.runtime.manifest import parse_manifest

SD_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "scheduler": ["diffusers", "PNDMScheduler"],
    "safety_checker": [None, None],
    "requires_safety_checker": False,
}
SD1_UNET = {"cross_attention_dim": 768, "attention_head_dim": 8}
SD1_TE = {"hidden_act": "quick_gelu", "hidden_size": 768}
SD2_UNET = {
    "cross_attention_dim": 1024,
    "attention_head_dim": [5, 10, 20, 20],
    "use_linear_projection": True,
    "upcast_attention": True,
}
SD2_TE = {"hidden_act": "gelu", "hidden_size": 1024, "num_hidden_layers": 23}
SDXL_UNET = {
    "cross_attention_dim": 2048,
    "addition_embed_type": "text_time",
    "use_linear_projection": True,
}


def detect(index=SD_INDEX, unet=SD1_UNET, te=SD1_TE):
    return load_families().detect(index, {"unet": unet, "text_encoder": te}, "/m")


def refusal(**kw) -> str:
    with pytest.raises(UserError) as info:
        detect(**kw)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("/m")
    return msg


def test_shipped_registry_loads_with_sd1_sd2_and_sdxl_supported():
    reg = load_families()
    assert [f.name for f in reg.families.values() if f.supported] == ["sd1", "sd2", "sdxl"]
    sd1 = reg.family("sd1")
    # SD 1.x's entry is what sdiree has always compiled and run
    assert list(sd1.submodules) == ["text_encoder", "unet", "vae_decoder", "vae_encoder"]
    assert sd1.submodules["unet"]["functions"] == ["denoise_cfg", "denoise"]
    assert sd1.size_multiple == 8 and sd1.pipeline == "text2img" in PIPELINES
    sdxl = reg.family("sdxl")
    # SDXL's recipe as data: two encoders' penultimate states, the second's pooled projection
    assert list(sdxl.submodules) == [
        "text_encoder", "text_encoder_2", "unet", "vae_decoder", "vae_encoder"
    ]  # fmt: skip
    assert [(te["submodule"], te["hidden_states"]) for te in sdxl.text_encoders] == [
        ("text_encoder", "penultimate"),
        ("text_encoder_2", "penultimate"),
    ]
    assert sdxl.unet_conditioning["text_embeds"] == "text_encoder_2"
    assert sdxl.vae_upcast == {"config_key": "force_upcast", "default": True}
    assert reg.family("sd1").vae_upcast is None and reg.family("sd1").unet_conditioning is None
    # nothing of SDXL refused any more (single files: issue 19); each encoder's TI vector set
    assert not sdxl.refusal
    assert [te["embedding"] for te in sdxl.text_encoders] == ["clip_l", "clip_g"]


def test_sd1_and_sd2_are_told_apart_by_their_configs():
    assert detect().name == "sd1"
    assert detect(unet=SD2_UNET, te=SD2_TE).name == "sd2"
    # keys absent take their library's defaults (quick_gelu, no linear projection)
    assert detect(unet={"cross_attention_dim": 768}, te={"hidden_size": 768}).name == "sd1"
    # an unreadable config decides nothing: the other one does
    assert detect(unet=None, te=SD2_TE).name == "sd2"


@pytest.mark.parametrize(
    "cls,says",
    [
        ("StableDiffusion3Pipeline", "Stable Diffusion 3"),
        ("FluxPipeline", "Flux"),
        ("StableDiffusionUpscalePipeline", "upscaler"),
        ("StableDiffusionControlNetPipeline", "ControlNet"),
        ("StableDiffusionXLControlNetPipeline", "SDXL ControlNet"),
    ],
)
def test_families_sdiree_does_not_compile_are_refused_by_name(cls, says):
    msg = refusal(index={**SD_INDEX, "_class_name": cls})
    assert cls in msg and says in msg
    assert "SD 1.x, SD 2.x, SDXL" in msg  # what it does compile


def test_a_controlnet_component_is_refused():
    msg = refusal(index={**SD_INDEX, "controlnet": ["diffusers", "ControlNetModel"]})
    assert "'controlnet'" in msg and "ControlNet" in msg


def test_an_sdxl_unet_with_one_text_encoder_is_a_mix():
    msg = refusal(unet=SDXL_UNET)
    assert "mixes model families" in msg
    assert 'addition_embed_type "text_time"' in msg and "cross_attention_dim 2048" in msg
    assert "StableDiffusionPipeline (SD 1.x or SD 2.x)" in msg and "1 text encoder" in msg


def test_an_sdxl_unet_under_an_unknown_class_is_sdxl():
    # the missing second encoder is then refused when the folder is checked (model_source)
    assert detect(index={**SD_INDEX, "_class_name": "MyPipeline"}, unet=SDXL_UNET).name == "sdxl"


SDXL_INDEX = {
    **SD_INDEX,
    "_class_name": "StableDiffusionXLPipeline",
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "force_zeros_for_empty_prompt": True,
}
SDXL_TE2 = {"hidden_act": "gelu", "hidden_size": 1280, "projection_dim": 1280}


def test_sdxl_is_recognised_and_its_widths_checked():
    reg = load_families()
    configs = {"unet": SDXL_UNET, "text_encoder": SD1_TE, "text_encoder_2": SDXL_TE2}
    assert reg.detect(SDXL_INDEX, configs, "/m").name == "sdxl"
    with pytest.raises(UserError, match=r"cross_attention_dim 2048 .* hidden_size 768 \+ 1024"):
        reg.detect(
            SDXL_INDEX, {**configs, "text_encoder_2": {**SDXL_TE2, "hidden_size": 1024}}, "/m"
        )
    # an SDXL index whose second encoder is quick_gelu (a CLIP-L copy) is a mix
    with pytest.raises(UserError, match="mixes model families"):
        reg.detect(SDXL_INDEX, {**configs, "text_encoder_2": SD1_TE}, "/m")


def test_sd1_unet_with_sd2_text_encoder_is_a_mix():
    msg = refusal(te=SD2_TE)
    assert "mixes model families" in msg and 'hidden_act "gelu"' in msg


def test_a_part_of_no_known_family_is_named():
    msg = refusal(
        index={**SD_INDEX, "_class_name": "Other"},
        unet={**SD1_UNET, "addition_embed_type": "image"},
    )
    assert "unet/config.json" in msg and "no model family sdiree knows" in msg


def test_unet_and_text_encoder_widths_must_agree():
    msg = refusal(te={**SD1_TE, "hidden_size": 1024})
    assert "cross_attention_dim 768 does not match" in msg and "hidden_size 1024" in msg


def test_a_damaged_registry_is_one_line(tmp_path):
    data = json.loads(default_path().read_text())
    data["families"]["sd1"]["pipeline"] = "img2vid"
    path = tmp_path / "families.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="families.sd1.pipeline names no pipeline"):
        load_families(path)
    del data["families"]["sd1"]
    data["families"]["sdxl"]["status"] = "refused"
    data["families"]["sdxl"].pop("refusal", None)
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="gives no 'refusal'"):
        load_families(path)


def _manifest(model: dict) -> dict:
    return {
        "schema_version": 2,
        "model": model,
        "target": {"name": "cpu", "arch": "host", "driver": "local-task"},
        "dtype": "fp32",
        "image": dict.fromkeys(
            ("height", "width", "batch_size", "latent_channels", "latent_height", "latent_width"),
            8,
        ),
        "scheduler": {"config": "scheduler/scheduler_config.json"},
        "text_encoders": [{"tokenizer": "tokenizer"}],
        "submodules": {},
        "files": {},
    }


def test_manifest_family_defaults_to_sd1_for_older_artifacts(tmp_path):
    old = parse_manifest(tmp_path, _manifest({"name": "m"}))
    assert (old.family, old.pipeline) == ("sd1", "text2img")
    new = parse_manifest(
        tmp_path, _manifest({"name": "m", "family": "sd2", "pipeline": "text2img"})
    )
    assert (new.family, new.pipeline) == ("sd2", "text2img")
    with pytest.raises(UserError, match="'model.family' is not a string"):
        parse_manifest(tmp_path, _manifest({"name": "m", "family": 2}))


def test_run_refuses_a_pipeline_it_does_not_have(tmp_path):
    from sdiree.runtime.pipeline import GenerationRequest, resolve_request

    m = parse_manifest(tmp_path, _manifest({"name": "m", "family": "sdxl", "pipeline": "sdxl"}))
    with pytest.raises(UserError, match="'sdxl' pipeline, which this sdiree does not have"):
        resolve_request(m, GenerationRequest("a cat"))
