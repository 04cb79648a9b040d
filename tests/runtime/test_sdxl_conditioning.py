"""runtime/conditioning: the UNet inputs SDXL's recipe makes from a prompt (two encoders'
hidden states joined, the second's pooled output, the size and crop ids, zeros for an empty
negative prompt), and SD 1.x's single encoder passed through untouched; no modules needed."""

from __future__ import annotations

import numpy as np
import pytest

from sdiree.runtime.conditioning import Conditioner
from sdiree.runtime.manifest import parse_manifest
from sdiree.runtime.text_inputs import EncodedText


def _fn(inputs, outputs=()):
    def t(name, shape, dtype):
        return {"name": name, "shape": list(shape), "dtype": dtype}

    return {"inputs": [t(*i) for i in inputs], "outputs": [t(*o) for o in outputs]}


def _manifest(tmp_path, sdxl: bool, unet_dtype="float16"):
    encoders = [{"submodule": "text_encoder", "tokenizer": "tokenizer"}]
    unet_inputs = [
        ("sample", (1, 4, 8, 8), unet_dtype),
        ("timestep", (1,), "float32"),
        ("encoder_hidden_states", (1, 77, 64 if sdxl else 32), unet_dtype),
    ]
    extra = {}
    if sdxl:
        encoders.append({"submodule": "text_encoder_2", "tokenizer": "tokenizer_2"})
        unet_inputs += [("text_embeds", (1, 16), unet_dtype), ("time_ids", (1, 6), "float32")]
        extra["conditioning"] = {
            "text_embeds": "text_encoder_2",
            "time_ids": ["original_size", "crops_coords_top_left", "target_size"],
            "zero_empty_negative": True,
        }
    sub = {"vmfb": "x.vmfb", "functions": {}}
    data = {
        "schema_version": 3,
        "model": {"name": "m", "family": "sdxl" if sdxl else "sd1", "pipeline": "text2img"},
        "target": {"name": "cpu", "arch": "host", "driver": "local-task"},
        "dtype": "fp16",
        "image": {
            "height": 48,
            "width": 64,
            "batch_size": 1,
            "latent_channels": 4,
            "latent_height": 6,
            "latent_width": 8,
        },
        "scheduler": {"config": "scheduler/scheduler_config.json"},
        "text_encoders": encoders,
        "submodules": {
            "unet": {**sub, "functions": {"denoise": _fn(unet_inputs)}},
            **{e["submodule"]: sub for e in encoders},
        },
        "files": {},
        **extra,
    }
    return parse_manifest(tmp_path, data)


class FakeInputs:
    def __init__(self, tag):
        self.tag = tag

    def encode(self, text):
        return EncodedText(np.zeros(77, np.int64), None, 3, 0, ())

    def arguments(self, enc):
        return [np.full((1,), self.tag)]


class FakeSession:
    """text_encoder gives hidden states of 1s (width 32) and text_encoder_2 of 2s, each with
    its own pooled output."""

    def __init__(self):
        self.calls = []

    def call(self, submodule, function, *args):
        self.calls.append((submodule, function))
        value = {"text_encoder": 1.0, "text_encoder_2": 2.0}[submodule]
        hidden = np.full((1, 77, 32), value, np.float32)
        return [hidden, np.full((1, 16), 10 * value, np.float32)]


def test_sdxl_conditioning_is_diffusers_recipe(tmp_path):
    m = _manifest(tmp_path, sdxl=True)
    session = FakeSession()
    cond = Conditioner(m, session, [FakeInputs(1), FakeInputs(2)])
    (hidden, text_embeds, time_ids), _ = cond.encode("a cat")
    assert session.calls == [("text_encoder", "encode"), ("text_encoder_2", "encode")]
    # [first encoder's 32 | second's 32] along the features, in the UNet's dtype
    assert hidden.shape == (1, 77, 64) and hidden.dtype == np.float16
    assert (hidden[..., :32] == 1).all() and (hidden[..., 32:] == 2).all()
    assert text_embeds.dtype == np.float16 and (text_embeds == 20).all()  # the second's pooled
    # (original size, crop top-left, target size) as (H, W), float32
    assert time_ids.dtype == np.float32 and time_ids.tolist() == [[48, 64, 0, 0, 48, 64]]
    assert cond.zero_empty_negative
    zeros = cond.zeros_like((hidden, text_embeds, time_ids))
    assert not zeros[0].any() and not zeros[1].any() and zeros[2] is time_ids


def test_sd1_conditioning_is_the_hidden_states_alone(tmp_path):
    m = _manifest(tmp_path, sdxl=False, unet_dtype="float32")
    cond = Conditioner(m, FakeSession(), [FakeInputs(1)])
    (hidden,), _ = cond.encode("a cat")
    assert hidden.shape == (1, 77, 32) and (hidden == 1).all()
    assert not cond.zero_empty_negative


def test_unknown_time_ids_are_refused(tmp_path):
    from sdiree.runtime.errors import UserError

    m = _manifest(tmp_path, sdxl=True)
    m.data["conditioning"]["time_ids"] = ["aesthetic_score"]
    with pytest.raises(UserError, match="time ids"):
        Conditioner(m, FakeSession(), [FakeInputs(1), FakeInputs(2)])
