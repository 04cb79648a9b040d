"""Text2Image's guided steps: the latents go to `denoise_cfg` once, or twice for artifacts whose
manifest declares the older signature (sample at batch 2B)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from sdiree.runtime.device import list_devices
from sdiree.runtime.manifest import load_manifest
from sdiree.runtime.pipeline import GenerationRequest, Text2Image, resolve_request
from sdiree.runtime.session import Session


def with_cfg_sample_batch(manifest, batch):
    """A copy of manifest whose denoise_cfg declares its sample at `batch`."""
    old = copy.deepcopy(manifest)
    fn = old.submodules["unet"].functions["denoise_cfg"]
    sample = dataclasses.replace(fn.inputs[0], shape=(batch, *fn.inputs[0].shape[1:]))
    old.submodules["unet"].functions["denoise_cfg"] = dataclasses.replace(
        fn, inputs=(sample, *fn.inputs[1:])
    )
    return old


def test_guided_steps_pass_the_latents_once_or_as_the_manifest_declares(compiled):
    manifest = load_manifest(compiled.get("cpu", "host", "fp32"))
    b = manifest.image["batch_size"]
    session = Session(manifest, list_devices("local-task")[0], Text2Image.SUBMODULES)
    req = resolve_request(
        manifest, GenerationRequest(prompt="a red cube", steps=2, scheduler="euler", seed=3)
    )
    real_call = session.call
    seen = []

    def record(sub, fn, *args):
        if fn == "denoise_cfg":
            seen.append(args[0].shape[0])
        return real_call(sub, fn, *args)

    session.call = record
    new = Text2Image(manifest, session).generate(req).images
    assert seen == [b, b]  # one per step, the latents once

    def as_before_revision_6(sub, fn, *args):
        if fn == "denoise_cfg":
            x = args[0]
            assert x.shape[0] == 2 * b and np.array_equal(x[:b], x[b:])
            args = (x[:b], *args[1:])
        return real_call(sub, fn, *args)

    session.call = as_before_revision_6
    old = Text2Image(with_cfg_sample_batch(manifest, 2 * b), session).generate(req).images
    np.testing.assert_array_equal(old, new)
