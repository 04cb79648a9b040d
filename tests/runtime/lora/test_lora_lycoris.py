"""LyCORIS LoHa and LoKr files (kohya naming) merge as peft's LoHa/LoKr layers merge the same
factors; full diffs add themselves; kinds sdiree has no formula for are named, not dropped.

diffusers cannot load LyCORIS files for SD 1.x, so the reference puts each file's factors into
peft's own LoHa/LoKr layers on the tiny model (injected with ranks and alphas per layer) and
lets peft merge them; the scale is peft's alpha / r. A LoKr layer with neither factor
decomposed has scale 1 in LyCORIS and A1111 (no rank to divide by): the reference gives that
layer alpha = r.
"""

from __future__ import annotations

import numpy as np
import pytest
from make_tiny_lora import COMPONENT_FILES, read_lora  # tools/ is on sys.path (tests/conftest.py)

from sdiree.runtime.errors import UserError
from sdiree.runtime.lora import plan_loras

STRENGTH = 0.7
COMPONENTS = tuple(COMPONENT_FILES)
ROLES = {
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
}


def _file_layers(path, model_shapes):
    """{(component, module name in the torch model): {role: tensor}, alpha} from the file,
    named with the generator's own kohya spelling (not sdiree's lookup)."""
    from make_tiny_lora import KOHYA, TEXT_MODEL, lora_layers

    by_stem = {
        KOHYA[c] + p.replace(".", "_"): (c, p.removeprefix(TEXT_MODEL))
        for c, p, _ in lora_layers(model_shapes)
    }
    tensors, _ = read_lora(path)
    layers: dict[tuple[str, str], dict] = {}
    for key, value in tensors.items():
        stem, _, role = key.partition(".")
        layers.setdefault(by_stem[stem], {})[role] = value
    return layers


def _rank(kind, t):
    if kind == "loha":
        return t["hada_w1_b"].shape[0]
    for role in ("lokr_w1_b", "lokr_w2_b"):
        if role in t:
            return t[role].shape[0]
    return None


def peft_merge(tiny_model, path, kind, model_shapes):
    """{component: state dict} after peft's LoHa/LoKr layers merge the file's factors."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, dtype=torch.float32)
    layers = _file_layers(path, model_shapes)
    for component in COMPONENTS:
        model = getattr(pipe, component)
        mine = {name: t for (c, name), t in layers.items() if c == component}
        ranks, alphas = {}, {}
        for name, t in mine.items():
            r = _rank(kind, t)
            ranks[name] = r or 1
            alphas[name] = float(t["alpha"]) if r else 1.0
        Config = peft.LoHaConfig if kind == "loha" else peft.LoKrConfig
        config = Config(
            r=1,
            alpha=1.0,
            target_modules=sorted(mine),
            rank_pattern={f"^{n}": r for n, r in ranks.items()},
            alpha_pattern={f"^{n}": a for n, a in alphas.items()},
            use_effective_conv2d=True,
        )
        peft.inject_adapter_in_model(config, model, adapter_name="x")
        for name, t in mine.items():
            layer = model.get_submodule(name)
            for role in ROLES[kind]:
                params = getattr(layer, role)
                if role in t:
                    params["x"] = torch.nn.Parameter(torch.from_numpy(t[role].copy()))
                elif "x" in params:
                    del params["x"]
            assert layer.r["x"] == ranks[name] and layer.alpha["x"] == alphas[name]
            layer.set_scale("x", STRENGTH)
            layer.merge(adapter_names=["x"])
    out = {}
    for component in COMPONENTS:
        state = getattr(pipe, component).state_dict()
        out[component] = {
            k.replace(".base_layer.", "."): v.detach().numpy()
            for k, v in state.items()
            if "hada_" not in k and "lokr_" not in k
        }
    return out


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_lycoris_matches_peft(
    kind, tiny_model, make_lora, model_shapes, sdiree_merge, assert_same_merge
):
    path = make_lora(kind)
    reference = peft_merge(tiny_model, path, kind, model_shapes)
    plan, merged = sdiree_merge([(path, STRENGTH)])
    assert plan.warnings() == []
    # every linear and conv layer of both models, 3x3 convs with CP factors among them
    assert assert_same_merge(plan, merged, reference) == 95
    tensors, _ = read_lora(path)
    if kind == "loha":
        assert any(k.endswith(".hada_t1") for k in tensors)
    else:
        for role in ("lokr_w1", "lokr_w1_a", "lokr_w2", "lokr_w2_a", "lokr_t2"):
            assert any(k.endswith("." + role) for k in tensors), role
        assert any(k.endswith(".lokr_w2") and v.ndim == 4 for k, v in tensors.items())


def test_full_diffs_add_to_weights_and_biases(make_lora, sdiree_merge, base_weights):
    path = make_lora("full")
    tensors, _ = read_lora(path)
    plan, merged = sdiree_merge([(path, 0.5)])
    assert plan.warnings() == []
    unet = merged["unet"]
    stem = "lora_unet_down_blocks_0_resnets_0_conv1"
    base = base_weights["unet"]
    want = base["down_blocks.0.resnets.0.conv1.weight"] + 0.5 * tensors[f"{stem}.diff"]
    np.testing.assert_allclose(unet["down_blocks.0.resnets.0.conv1.weight"], want, rtol=1e-6)
    want_b = base["down_blocks.0.resnets.0.conv1.bias"] + 0.5 * tensors[f"{stem}.diff_b"]
    np.testing.assert_allclose(unet["down_blocks.0.resnets.0.conv1.bias"], want_b, rtol=1e-6)
    te_key = "encoder.layers.1.mlp.fc2.bias"
    te_diff = tensors["lora_te_text_model_encoder_layers_1_mlp_fc2.diff_b"]
    np.testing.assert_allclose(
        merged["text_encoder"][te_key], base_weights["text_encoder"][te_key] + 0.5 * te_diff
    )


def _loha_layer(rng, out_dim, in_dim, rank=2):
    return {
        "hada_w1_a": rng.standard_normal((out_dim, rank)).astype(np.float32),
        "hada_w1_b": rng.standard_normal((rank, in_dim)).astype(np.float32),
        "hada_w2_a": rng.standard_normal((out_dim, rank)).astype(np.float32),
        "hada_w2_b": rng.standard_normal((rank, in_dim)).astype(np.float32),
    }


def test_scale_key_overrides_alpha(model_shapes):
    rng = np.random.default_rng(0)
    stem = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    factors = _loha_layer(rng, 32, 32)
    tensors = {f"{stem}.{k}": v for k, v in factors.items()}
    tensors[f"{stem}.alpha"] = np.array(1.0, np.float32)
    key = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    by_alpha = plan_loras([("a", tensors, {}, 1.0)], model_shapes).delta("unet", key)
    tensors[f"{stem}.scale"] = np.array(3.0, np.float32)
    by_scale = plan_loras([("a", tensors, {}, 1.0)], model_shapes).delta("unet", key)
    want = (factors["hada_w1_a"] @ factors["hada_w1_b"]) * (
        factors["hada_w2_a"] @ factors["hada_w2_b"]
    )
    np.testing.assert_allclose(by_alpha, want / 2, rtol=1e-6)  # alpha 1 / rank 2
    np.testing.assert_allclose(by_scale, want * 3, rtol=1e-6)


def test_unsupported_kinds_named_in_a_warning_or_refused(model_shapes):
    rng = np.random.default_rng(0)
    lora = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    tensors = {
        f"{lora}.lora_down.weight": rng.standard_normal((2, 32)).astype(np.float32),
        f"{lora}.lora_up.weight": rng.standard_normal((32, 2)).astype(np.float32),
        "lora_unet_mid_block_attentions_0_proj_in.oft_blocks": np.zeros((4, 8, 8), np.float32),
        "lora_unet_mid_block_attentions_0_proj_out.weight": np.ones(32, np.float32),
        "lora_unet_mid_block_attentions_0_proj_out.on_input": np.array(True),
    }
    plan = plan_loras([("mix", tensors, {}, 1.0)], model_shapes)
    assert plan.keys("unet") == [
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    ]
    text = "\n".join(plan.warnings())
    assert "1 layers are oft layers" in text and "mid_block_attentions_0_proj_in" in text
    assert "1 layers are ia3 layers" in text
    assert "1 keys fit no known LoRA layout" in text
    assert "lora_unet_mid_block_attentions_0_proj_out.weight" in text

    only = {k: v for k, v in tensors.items() if "proj_" in k}
    with pytest.raises(UserError, match=r"has only ia3, oft layers, which sdiree cannot apply"):
        plan_loras([("oft", only, {}, 1.0)], model_shapes)


def test_incomplete_layers_are_reported(model_shapes):
    rng = np.random.default_rng(0)
    stem = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    tensors = {f"{stem}.{k}": v for k, v in _loha_layer(rng, 32, 32).items()}
    tensors["lora_unet_mid_block_attentions_0_proj_in.hada_w1_a"] = np.ones((32, 2), np.float32)
    plan = plan_loras([("part", tensors, {}, 1.0)], model_shapes)
    assert len(plan.keys("unet")) == 1
    (warning,) = plan.warnings()
    assert "1 layers lack a factor" in warning and "no w1_b, w2_a, w2_b" in warning
    with pytest.raises(UserError, match="none of its layers is complete.*damaged"):
        plan_loras(
            [("part", {k: v for k, v in tensors.items() if "proj_in" in k}, {}, 1)], model_shapes
        )
