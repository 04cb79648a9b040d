"""Textual-inversion embeddings end to end on the compiled tiny model, without a recompile:
the compiled text encoder's hidden states and the finished image against diffusers'
`load_textual_inversion` on the same weights, on cpu and lavapipe."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from parity import DIFFUSERS_SCHEDULERS, psnr  # noqa: E402

from sdiree.runtime.device_select import choose_device  # noqa: E402
from sdiree.runtime.embeddings import load_embedding  # noqa: E402
from sdiree.runtime.image_output import to_uint8  # noqa: E402
from sdiree.runtime.manifest import load_manifest  # noqa: E402
from sdiree.runtime.pipeline import GenerationRequest, Text2Image, resolve_request  # noqa: E402
from sdiree.runtime.session import Session  # noqa: E402
from sdiree.runtime.text_inputs import TextInputs  # noqa: E402
from sdiree.runtime.weights.archive import Archive  # noqa: E402

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

PROMPT = "a photo of <my-cat> in the style of <style-x>, oil painting"
NEGATIVE = "blurry, <style-x>"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A1111-style one-vector file and a diffusers three-vector file, with vectors as large as
    the tiny table's rows, so they change the image."""
    d = tmp_path_factory.mktemp("emb")
    g = torch.Generator().manual_seed(5)
    one, three = d / "my-cat.safetensors", d / "learned_embeds.safetensors"
    safetensors_torch.save_file({"emb_params": torch.randn(1, 32, generator=g)}, one)
    safetensors_torch.save_file({"<style-x>": torch.randn(3, 32, generator=g)}, three)
    return one, three


# lavapipe runs the tiny UNet at ~2 s a step, so its image takes fewer steps.
TARGETS = {"cpu": ("cpu", "host", 20), "lavapipe": ("vulkan-spirv", "lavapipe", 8)}


@pytest.fixture(scope="module", params=list(TARGETS))
def session(request, compiled):
    target, arch, steps = TARGETS[request.param]
    manifest = load_manifest(compiled.get(target, arch, "fp32"))
    info, _ = choose_device(manifest, None)
    return manifest, Session(manifest, info, Text2Image.SUBMODULES), steps


def reference_pipe(model_dir, files):
    import diffusers

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(
        model_dir, safety_checker=None, requires_safety_checker=False, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    cls_name, overrides = DIFFUSERS_SCHEDULERS["euler"]
    pipe.scheduler = getattr(diffusers, cls_name).from_config(pipe.scheduler.config, **overrides)
    one, three = files
    pipe.load_textual_inversion(str(one), token="<my-cat>")
    pipe.load_textual_inversion(str(three))
    return pipe


def diffusers_image(pipe, prompt, negative, seed, steps):
    out = pipe(
        prompt,
        negative_prompt=negative,
        num_inference_steps=steps,
        guidance_scale=7.5,
        generator=torch.Generator("cpu").manual_seed(seed),
        height=64,
        width=64,
        output_type="np",
    ).images
    return (out * 255).round().astype(np.uint8)


def test_compiled_text_encoder_matches_diffusers(compiled, session, files):
    manifest, session, _ = session
    one, three = files
    inputs = TextInputs.for_artifact(
        manifest, [load_embedding(one, "<my-cat>"), load_embedding(three)]
    )
    decl = session.decl("text_encoder", "encode")
    assert [t.name for t in decl.inputs] == ["inputs_embeds", "eos_index"]
    pipe = reference_pipe(compiled.model, files)
    for prompt in (PROMPT, NEGATIVE, "a photo of a cat"):
        enc = inputs.encode(prompt)
        hidden, pooled = session.call("text_encoder", "encode", *inputs.arguments(enc, decl))
        ids = pipe.tokenizer(
            pipe.maybe_convert_prompt(prompt, pipe.tokenizer),
            padding="max_length",
            max_length=77,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        assert enc.ids.tolist() == ids[0].tolist()
        with torch.no_grad():
            out = pipe.text_encoder(ids)
        want, want_pooled = out.last_hidden_state[0].numpy(), out.pooler_output[0].numpy()
        scale = np.abs(want).max()
        assert np.abs(hidden[0] - want).max() <= 1e-5 * scale, prompt
        assert np.abs(pooled[0] - want_pooled).max() <= 1e-5 * scale, prompt


def test_one_token_table_read_from_the_archive_or_replaced(session):
    """The table the runtime looks ids up in is the text encoder's own archive entry (the
    artifact holds no second copy), or the one `--weights` loads in its place."""
    manifest, _, _ = session
    sub = manifest.submodules["text_encoder"]
    tables = [
        k
        for rel, _ in sub.archives()
        for k in Archive(manifest.path(rel)).entries
        if k.endswith("token_embedding.weight")
    ]
    assert tables == ["embeddings.token_embedding.weight"]
    own = TextInputs.for_artifact(manifest).table
    assert isinstance(own, np.memmap) and not own.flags.writeable  # a view of the file
    other = np.ascontiguousarray(own[::-1])
    inputs = TextInputs.for_artifact(manifest, replaced={tables[0]: other})
    enc = inputs.encode("a photo of a cat")
    np.testing.assert_array_equal(enc.embeds, other[enc.ids])


def sdiree_image(manifest, session, inputs, prompt, negative, seed, steps):
    """The image Text2Image makes when its text encoding goes through `inputs` (what
    pipeline.encode_text does with --embedding)."""
    pipe = Text2Image(manifest, session)
    decl = session.decl("text_encoder", "encode")

    def encode_text(text, warnings):
        hidden, _ = session.call(
            "text_encoder", "encode", *inputs.arguments(inputs.encode(text), decl)
        )
        return hidden

    pipe.encode_text = encode_text
    req = resolve_request(
        manifest, GenerationRequest(prompt, negative, steps, 7.5, "euler", seed, 1)
    )
    return to_uint8(pipe.generate(req, progress=None).images)


def test_image_matches_diffusers_load_textual_inversion(compiled, session, files):
    manifest, session, steps = session
    one, three = files
    inputs = TextInputs.for_artifact(
        manifest, [load_embedding(one, "<my-cat>"), load_embedding(three)]
    )
    ours = sdiree_image(manifest, session, inputs, PROMPT, NEGATIVE, 42, steps)
    pipe = reference_pipe(compiled.model, files)
    ref = diffusers_image(pipe, PROMPT, NEGATIVE, 42, steps)
    assert psnr(ours, ref) >= 40.0
    if manifest.target == "cpu":  # the embeddings matter: without them, another image
        plain = TextInputs.for_artifact(manifest)
        plain = sdiree_image(manifest, session, plain, PROMPT, NEGATIVE, 42, steps)
        assert psnr(plain, ref) < 35.0
