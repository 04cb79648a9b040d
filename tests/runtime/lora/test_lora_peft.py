"""diffusers/PEFT LoRA files (``lora_A``/``lora_B``, ranks and alphas in diffusers'
``lora_adapter_metadata``, rsLoRA, ``lora_B`` biases, the older attention-processor layout)
merge as diffusers' `load_lora_weights` + `fuse_lora` merges them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from make_tiny_lora import read_lora  # tools/ is on sys.path (tests/conftest.py)

from sdiree.runtime.errors import UserError
from sdiree.runtime.lora import plan_loras

STRENGTH = 0.8


@pytest.mark.parametrize("fmt", ["peft", "peft-noalpha", "diffusers-old"])
def test_peft_layouts_match_diffusers(
    fmt, make_lora, sdiree_merge, diffusers_merge, assert_same_merge
):
    path = make_lora(fmt)
    tensors, metadata = read_lora(path)
    if fmt == "peft":
        config = json.loads(metadata["lora_adapter_metadata"])
        assert config["unet.alpha_pattern"] and config["unet.rank_pattern"]
    plan, merged = sdiree_merge([(path, STRENGTH)])
    assert plan.warnings() == []
    assert assert_same_merge(plan, merged, diffusers_merge([(path, STRENGTH)])) == 95


def test_peft_matches_diffusers_on_sd2(sd2):
    path = sd2.make_lora("peft")
    plan, merged = sd2.sdiree_merge([(path, STRENGTH)])
    assert plan.warnings() == []
    assert sd2.assert_same_merge(plan, merged, sd2.diffusers_merge([(path, STRENGTH)])) == 150


def _rewrite(path, tmp_path, tensors=None, metadata=None):
    from safetensors.numpy import save_file

    old_tensors, old_metadata = read_lora(path)
    out = tmp_path / path.name
    save_file(
        old_tensors if tensors is None else tensors,
        str(out),
        metadata=old_metadata if metadata is None else metadata,
    )
    return out


def test_rslora_matches_diffusers(
    make_lora, tmp_path, sdiree_merge, diffusers_merge, assert_same_merge
):
    path = make_lora("peft", seed=5)
    _, metadata = read_lora(path)
    config = json.loads(metadata["lora_adapter_metadata"])
    config["unet.use_rslora"] = True
    path = _rewrite(path, tmp_path, metadata={"lora_adapter_metadata": json.dumps(config)})
    plan, merged = sdiree_merge([(path, STRENGTH)])
    assert assert_same_merge(plan, merged, diffusers_merge([(path, STRENGTH)])) == 95


def test_lora_b_bias_matches_diffusers(
    make_lora, tmp_path, model_shapes, sdiree_merge, diffusers_merge, assert_same_merge
):
    """peft's lora_bias: lora_B's bias, scaled like the weight, added to the layer's bias."""
    tensors, _ = read_lora(make_lora("peft-noalpha", seed=6))
    rng = np.random.default_rng(0)
    with_bias = {}
    for key, value in tensors.items():
        component, _, rest = key.partition(".")
        layer = rest.rpartition(".lora_")[0]
        bias_key = layer.removeprefix("text_model.") + ".bias"
        if bias_key not in model_shapes[component]:
            continue
        with_bias[key] = value
        if ".lora_B." in key:
            with_bias[f"{component}.{layer}.lora_B.bias"] = rng.standard_normal(
                value.shape[0]
            ).astype(np.float32)
    path = _rewrite(make_lora("peft-noalpha", seed=6), tmp_path, tensors=with_bias, metadata={})
    plan, merged = sdiree_merge([(path, STRENGTH)])
    assert plan.warnings() == []
    assert "down_blocks.0.resnets.0.conv1.bias" in plan.keys("unet")
    assert assert_same_merge(plan, merged, diffusers_merge([(path, STRENGTH)])) > 120


def test_unprefixed_attention_processor_file_is_the_unet(make_lora, model_shapes):
    tensors, _ = read_lora(make_lora("diffusers-old"))
    unet_only = {k.removeprefix("unet."): v for k, v in tensors.items() if k.startswith("unet.")}
    assert any(".processor.to_out_lora." in k for k in unet_only)
    prefixed = plan_loras([("a", tensors, {}, STRENGTH)], model_shapes)
    bare = plan_loras([("a", unet_only, {}, STRENGTH)], model_shapes)
    assert bare.components == ["unet"] and bare.warnings() == []
    assert bare.keys("unet") == prefixed.keys("unet")
    for key in bare.keys("unet"):
        assert np.array_equal(bare.delta("unet", key), prefixed.delta("unet", key))


def test_alpha_keys_in_a_peft_file_scale_like_kohya(model_shapes):
    rng = np.random.default_rng(0)
    layer = "unet.down_blocks.0.attentions.0.proj_in"
    down = rng.standard_normal((4, 32, 1, 1)).astype(np.float32)
    up = rng.standard_normal((32, 4, 1, 1)).astype(np.float32)
    tensors = {
        f"{layer}.lora_A.weight": down,
        f"{layer}.lora_B.weight": up,
        f"{layer}.alpha": np.array(2.0, np.float32),
    }
    plan = plan_loras([("a", tensors, {}, 0.5)], model_shapes)
    want = (up[:, :, 0, 0] @ down[:, :, 0, 0])[:, :, None, None] * 0.5 * 2.0 / 4
    np.testing.assert_allclose(
        plan.delta("unet", "down_blocks.0.attentions.0.proj_in.weight"), want, rtol=1e-6
    )


def test_bad_adapter_metadata_is_refused(make_lora, model_shapes):
    tensors, _ = read_lora(make_lora("peft"))
    for raw, problem in (("{not json", "is not valid JSON"), ("[1]", "is not a JSON object")):
        with pytest.raises(
            UserError, match=f"LoRA p: its lora_adapter_metadata metadata {problem}"
        ):
            plan_loras([("p", tensors, {"lora_adapter_metadata": raw}, 1.0)], model_shapes)
