"""kohya LoRA files (sd-scripts' layout, diffusers- and LDM-named UNet, LoCon convs) merge as
diffusers' `load_lora_weights` + `fuse_lora` merges them; bad files are refused in one line.

The reference is diffusers on the same file where it reads it right. It applies a kohya file's
alphas through peft's alpha_pattern, which it spells wrongly for attention and text-encoder
layers (its warning: "alpha_pattern keys did not match any targeted module"), so files with one
alpha per layer are checked against diffusers on the same factors written as a PEFT file, and
the kohya test files diffusers reads directly have kohya's usual two alphas (linear, conv).
diffusers reads LDM-named UNet layers only with the UNet's config and then misplaces the
upsampler of a block without attention, so those are checked against the same factors
diffusers-named; the naming itself against diffusers' single-file checkpoint conversion.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from make_tiny_lora import read_lora  # tools/ is on sys.path (tests/conftest.py)

from sdiree.runtime.errors import UserError
from sdiree.runtime.lora import plan_loras
from sdiree.runtime.lora.ldm_names import ldm_unet_names

STRENGTH = 0.8


def test_kohya_matches_diffusers(make_lora, sdiree_merge, diffusers_merge, assert_same_merge):
    path = make_lora("kohya", alphas="kohya")
    plan, merged = sdiree_merge([(path, STRENGTH)])
    assert plan.warnings() == []
    assert plan.reports[0].applied == {"unet": 83, "text_encoder": 12}
    assert assert_same_merge(plan, merged, diffusers_merge([(path, STRENGTH)])) == 95


def test_kohya_alpha_per_layer_matches_diffusers_on_the_peft_twin(
    make_lora, sdiree_merge, diffusers_merge, assert_same_merge
):
    plan, merged = sdiree_merge([(make_lora("kohya"), STRENGTH)])
    reference = diffusers_merge([(make_lora("peft"), STRENGTH)])
    assert assert_same_merge(plan, merged, reference) == 95


def test_ldm_named_unet_equals_diffusers_named(
    make_lora, sdiree_merge, diffusers_merge, assert_same_merge
):
    ldm_path = make_lora("kohya-ldm", alphas="kohya")
    tensors, _ = read_lora(ldm_path)
    for spelled in ("input_blocks_1_1_", "middle_block_1_", "output_blocks_1_1_conv", "op."):
        assert any(spelled in k for k in tensors), spelled
    assert not any("down_blocks" in k for k in tensors)
    plan, merged = sdiree_merge([(ldm_path, STRENGTH)])
    assert plan.warnings() == []
    named_plan, named = sdiree_merge([(make_lora("kohya", alphas="kohya"), STRENGTH)])
    for c in named:
        assert plan.keys(c) == named_plan.keys(c)
        for k in named[c]:
            assert np.array_equal(merged[c][k], named[c][k]), k
    reference = diffusers_merge([(make_lora("kohya", alphas="kohya"), STRENGTH)])
    assert assert_same_merge(plan, merged, reference) == 95


def _meta_unet(config: dict) -> tuple[list[str], dict]:
    """The state-dict keys and config of a full-size UNet, made without allocating weights."""
    torch = pytest.importorskip("torch")
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
    return list(unet.state_dict()), dict(unet.config)


SD15 = dict(
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=768,
    attention_head_dim=8,
)
SDXL = dict(
    layers_per_block=2,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)


@pytest.mark.parametrize("family", ["tiny", "sd15", "sdxl"])
def test_ldm_names_agree_with_diffusers_single_file_conversion(family, tiny_model, model_shapes):
    """Every UNet key spelled the original way by ldm_names is put back under its own
    diffusers key by diffusers' converter of original checkpoints."""
    torch = pytest.importorskip("torch")
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    if family == "tiny":
        keys = list(model_shapes["unet"])
        config = json.loads((tiny_model / "unet" / "config.json").read_text())
    else:
        keys, config = _meta_unet(SD15 if family == "sd15" else SDXL)
    paths = {k.rpartition(".")[0] for k in keys}
    to_ldm = {d: o for o, d in ldm_unet_names(paths).items()}
    assert set(to_ldm) == paths  # every layer has an original name
    checkpoint = {}
    for i, key in enumerate(keys):
        path, _, leaf = key.rpartition(".")
        checkpoint[f"model.diffusion_model.{to_ldm[path]}.{leaf}"] = torch.tensor([float(i)])
    converted = convert_ldm_unet_checkpoint(checkpoint, config)
    assert set(converted) == set(keys)
    for i, key in enumerate(keys):
        assert float(converted[key][0]) == i, key


def test_cp_locon_equals_its_three_convolutions(make_lora, model_shapes):
    """A CP-decomposed LoCon layer (1x1 down, kxk mid, 1x1 up) applied as three convolutions
    (torch) changes a conv's output as the merged delta does."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    path = make_lora("kohya-cp")
    tensors, metadata = read_lora(path)
    plan = plan_loras([("cp", tensors, metadata, STRENGTH)], model_shapes)
    stem = "lora_unet_down_blocks_0_resnets_0_conv1"
    assert f"{stem}.lora_mid.weight" in tensors
    down, mid, up = (
        torch.from_numpy(tensors[f"{stem}.lora_{r}.weight"]) for r in ("down", "mid", "up")
    )
    scale = float(tensors[f"{stem}.alpha"]) / down.shape[0]
    x = torch.randn(2, down.shape[1], 8, 8, generator=torch.Generator().manual_seed(0))
    want = F.conv2d(F.conv2d(F.conv2d(x, down), mid, padding=1), up) * scale * STRENGTH
    delta = torch.from_numpy(plan.delta("unet", "down_blocks.0.resnets.0.conv1.weight"))
    torch.testing.assert_close(F.conv2d(x, delta, padding=1), want, rtol=1e-5, atol=1e-5)


def test_several_loras_match_diffusers_adapters(
    make_lora, sdiree_merge, diffusers_merge, assert_same_merge
):
    loras = [
        (make_lora("kohya", seed=1, alphas="kohya"), 0.8),
        (make_lora("peft", seed=2), -0.5),
        (make_lora("kohya", seed=3, alphas="kohya", components=("unet",), convs=False), 1.3),
    ]
    plan, merged = sdiree_merge(loras)
    assert [r.applied for r in plan.reports] == [
        {"unet": 83, "text_encoder": 12},
        {"unet": 83, "text_encoder": 12},
        {"unet": 50},
    ]
    assert assert_same_merge(plan, merged, diffusers_merge(loras)) == 95


def test_text_encoder_strength_of_its_own(make_lora, model_shapes, base_weights, diffusers_merge):
    from sdiree.runtime.lora import LoraSpec

    path = make_lora("kohya", seed=4, alphas="kohya")
    plan = plan_loras(
        [LoraSpec("s", *read_lora(path), strength=0.9, te_strength=0.25)], model_shapes
    )
    whole = diffusers_merge([(path, 0.9)])
    te_only = diffusers_merge([(path, 0.25)])
    for c, reference in (("unet", whole), ("text_encoder", te_only)):
        for k in plan.keys(c):
            np.testing.assert_allclose(
                plan.merged(c, k, base_weights[c][k]), reference[c][k], rtol=1e-5, atol=1e-6
            )


def test_merge_keeps_the_base_dtype_and_rounds_once(make_lora, model_shapes, base_weights):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    plan = plan_loras([("k", *read_lora(make_lora("kohya")), STRENGTH)], model_shapes)
    key = "down_blocks.0.resnets.0.conv1.weight"
    delta = plan.delta("unet", key)
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        base = base_weights["unet"][key].astype(dtype)
        merged = plan.merged("unet", key, base)
        assert merged.dtype == dtype and merged.shape == base.shape
        want = (base.astype(np.float32) + delta).astype(dtype)
        assert np.array_equal(merged.view(np.uint8), want.view(np.uint8))
    unchanged = base_weights["unet"]["conv_norm_out.weight"]
    assert plan.merged("unet", "conv_norm_out.weight", unchanged) is unchanged


def test_strength_zero_changes_nothing(make_lora, model_shapes):
    plan = plan_loras([("k", *read_lora(make_lora("kohya")), 0.0)], model_shapes)
    assert plan.components == [] and plan.reports[0].applied["unet"] == 83


def test_text_encoder_keys_with_or_without_text_model_prefix(make_lora, model_shapes):
    prefixed = dict(model_shapes)
    prefixed["text_encoder"] = {
        f"text_model.{k}": s for k, s in model_shapes["text_encoder"].items()
    }
    lora = ("k", *read_lora(make_lora("kohya")), STRENGTH)
    plain = plan_loras([lora], model_shapes)
    plan = plan_loras([lora], prefixed)
    assert plan.keys("text_encoder") == [f"text_model.{k}" for k in plain.keys("text_encoder")]
    assert len(plan.keys("text_encoder")) == 12


def test_a_layer_under_two_names_applies_once(make_lora, model_shapes):
    named, _ = read_lora(make_lora("kohya"))
    ldm, _ = read_lora(make_lora("kohya-ldm"))
    single = plan_loras([("k", named, {}, STRENGTH)], model_shapes)
    both = plan_loras([("k", {**ldm, **named}, {}, STRENGTH)], model_shapes)
    assert both.keys("unet") == single.keys("unet")
    key = "up_blocks.0.upsamplers.0.conv.weight"
    assert np.array_equal(both.delta("unet", key), single.delta("unet", key))
    (warning,) = both.warnings()
    assert "83 layers repeat a layer already applied under another name" in warning
    assert "input_blocks" in warning


def test_unmatched_and_unknown_keys_are_reported(make_lora, model_shapes):
    tensors, metadata = read_lora(make_lora("kohya"))
    extra = {
        "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": np.ones((2, 32), "f4"),
        "lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": np.ones((64, 2), "f4"),
        "lora_unet_no_such_layer.lora_down.weight": np.ones((2, 32), "f4"),
        "lora_unet_no_such_layer.lora_up.weight": np.ones((32, 2), "f4"),
        "something_else": np.ones(3, "f4"),
    }
    plan = plan_loras([("extra", {**tensors, **extra}, metadata, STRENGTH)], model_shapes)
    assert plan.reports[0].applied == {"unet": 83, "text_encoder": 12}
    unmatched, unknown = plan.warnings()
    assert unmatched.startswith("LoRA extra: 2 of its 97 layers match no weight of this model")
    assert "lora_te2_text_model_encoder_layers_0_mlp_fc1" in unmatched
    assert "lora_unet_no_such_layer" in unmatched
    assert unknown == "LoRA extra: 1 keys fit no known LoRA layout and are ignored: something_else"


def test_lora_for_another_family_is_refused(make_lora, model_shapes, tiny_sd2_model, tmp_path):
    from make_tiny_lora import make_tiny_lora

    path = make_tiny_lora(tiny_sd2_model, tmp_path / "sd2.safetensors", "kohya")
    with pytest.raises(UserError) as e:
        plan_loras([("sd2", *read_lora(path), 1.0)], model_shapes)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("LoRA sd2 does not fit this model: its layer lora_")
    assert "is it a LoRA for another model family?" in message


def test_bad_files_and_strengths_are_refused_in_one_line(make_lora, model_shapes, base_weights):
    tensors, metadata = read_lora(make_lora("kohya"))
    cases = [
        (
            {
                k.replace("lora_unet_", "lora_unet_other_"): v
                for k, v in tensors.items()
                if k.startswith("lora_unet_")
            },
            1.0,
            "LoRA f matches none of this model's weights (its 83 layers, e.g. "
            "lora_unet_other_conv_in): is it a LoRA for another model family?",
        ),
        (tensors, float("nan"), "LoRA f: strength nan is not a finite number"),
        (tensors, float("inf"), "LoRA f: strength inf is not a finite number"),
        (
            dict(base_weights["unet"]),
            1.0,
            "f holds no LoRA weights (none of its 208 keys, e.g. 'conv_in.bias', is a LoRA "
            "factor): is it a LoRA file?",
        ),
        ({}, 1.0, "f holds no LoRA weights (none of its 0 keys is a LoRA factor)"),
        (
            {**tensors, "lora_unet_conv_in.dora_scale": np.ones((1, 4, 1, 1), "f4")},
            1.0,
            "LoRA f is a DoRA (weight-decomposed) LoRA (lora_unet_conv_in), which sdiree "
            "cannot apply",
        ),
        (
            {**tensors, "lora_unet_conv_in.lora_up.weight": np.ones((32, 3, 1, 1), "f4")},
            1.0,
            "LoRA f: layer lora_unet_conv_in: lora_up (32, 3, 1, 1) and lora_down",
        ),
    ]
    for lora, strength, message in cases:
        with pytest.raises(UserError) as e:
            plan_loras([("f", lora, metadata, strength)], model_shapes)
        assert str(e.value).startswith(message), str(e.value)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt", ["kohya", "kohya-ldm"])
def test_sd2_matches_diffusers(fmt, sd2):
    """SD 2.x: linear proj_in/proj_out, three blocks with attention, a 3-layer text encoder."""
    path = sd2.make_lora(fmt, alphas="kohya")
    plan, merged = sd2.sdiree_merge([(path, STRENGTH)])
    assert plan.warnings() == []
    named = sd2.make_lora("kohya", alphas="kohya")
    reference = sd2.diffusers_merge([(named, STRENGTH)])
    assert sd2.assert_same_merge(plan, merged, reference) == 150


TORCH_FREE = """
import sys
BANNED = ("torch", "diffusers", "transformers", "safetensors", "peft", "iree.compiler")

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BANNED):
            raise ImportError(f"imported {name}")

sys.meta_path.insert(0, Blocker())
import numpy as np
from sdiree.runtime.lora import plan_loras, extract_prompt_loras

targets = {"unet": {"down_blocks.0.attentions.0.proj_in.weight": (8, 8, 1, 1)}}
lora = {
    "lora_unet_input_blocks_1_1_proj_in.lora_down.weight": np.ones((2, 8, 1, 1), np.float16),
    "lora_unet_input_blocks_1_1_proj_in.lora_up.weight": np.ones((8, 2, 1, 1), np.float16),
    "lora_unet_input_blocks_1_1_proj_in.alpha": np.array(1.0, np.float16),
}
targets["unet"]["down_blocks.0.resnets.0.conv1.weight"] = (8, 8, 3, 3)
plan = plan_loras([("x", lora, {}, 0.5)], targets)
merged = plan.merged("unet", "down_blocks.0.attentions.0.proj_in.weight", np.zeros((8, 8, 1, 1)))
assert float(merged.max()) == 0.5, merged.max()
print("ok", extract_prompt_loras("<lora:x:1>")[1][0].name)
"""


def test_lora_merge_runs_without_torch():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok x"


def test_sdxl_style_te1_te2_prefixes_reach_both_text_encoders(make_lora, model_shapes):
    tensors, _ = read_lora(make_lora("kohya", components=("text_encoder",)))
    te1 = {k.replace("lora_te_", "lora_te1_"): v for k, v in tensors.items()}
    te2 = {k.replace("lora_te_", "lora_te2_"): v for k, v in tensors.items()}
    targets = {"text_encoder": model_shapes["text_encoder"]}
    targets["text_encoder_2"] = {f"text_model.{k}": s for k, s in targets["text_encoder"].items()}
    plan = plan_loras([("xl", {**te1, **te2}, {}, 0.6)], targets)
    assert plan.warnings() == []
    keys = plan.keys("text_encoder")
    assert len(keys) == 12 and plan.keys("text_encoder_2") == [f"text_model.{k}" for k in keys]
    for k in keys:
        np.testing.assert_array_equal(
            plan.delta("text_encoder", k), plan.delta("text_encoder_2", f"text_model.{k}")
        )
    # on a model with one text encoder, the second's layers are reported, not dropped
    one = plan_loras([("xl", {**te1, **te2}, {}, 0.6)], {"text_encoder": targets["text_encoder"]})
    (warning,) = one.warnings()
    assert warning.startswith("LoRA xl: 12 of its 24 layers match no weight of this model")
    assert "lora_te2_text_model_encoder_layers_0" in warning
