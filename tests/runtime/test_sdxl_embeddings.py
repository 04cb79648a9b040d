"""SDXL textual-inversion embeddings (`clip_l` + `clip_g` files) on the compiled tiny SDXL,
without a recompile: each vector set goes into its own text encoder, and both encoders'
outputs and the finished image match diffusers' StableDiffusionXLPipeline with the sets loaded
per encoder (`load_textual_inversion(..., text_encoder=..., tokenizer=...)`). An SDXL embedding
on an SD 1.x/2.x model and an SD 1.x/2.x one on SDXL are one line each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from parity import DIFFUSERS_SCHEDULERS, psnr  # noqa: E402

from sdiree.runtime.device_select import choose_device  # noqa: E402
from sdiree.runtime.embeddings import load_embedding  # noqa: E402
from sdiree.runtime.errors import UserError  # noqa: E402
from sdiree.runtime.image_output import to_uint8  # noqa: E402
from sdiree.runtime.manifest import load_manifest  # noqa: E402
from sdiree.runtime.pipeline import (  # noqa: E402
    GenerationRequest,
    Text2Image,
    pipeline_submodules,
    resolve_request,
)
from sdiree.runtime.session import Session  # noqa: E402
from sdiree.runtime.text_inputs import TextInputs  # noqa: E402
from sdiree.runtime.tokenizer import ClipTokenizer  # noqa: E402

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

PROMPT = "a photo of <xl-cat> in the style of <xl-style>, oil painting"
NEGATIVE = "blurry, <xl-style>"
STEPS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A one-vector and a three-vector SDXL embedding (clip_l for the first encoder, clip_g for
    the second; the tiny encoders are both 32 wide), four times the table's scale, so they
    change the image."""
    d = tmp_path_factory.mktemp("xl-emb")
    g = torch.Generator().manual_seed(11)
    one, three = d / "xl-cat.safetensors", d / "xl-style.safetensors"
    for path, n in ((one, 1), (three, 3)):
        safetensors_torch.save_file(
            {
                "clip_l": 4 * torch.randn(n, 32, generator=g),
                "clip_g": 4 * torch.randn(n, 32, generator=g),
            },
            path,
        )
    return one, three


@pytest.fixture(scope="module")
def session(compiled_sdxl):
    manifest = load_manifest(compiled_sdxl.get("cpu", "host", "fp32"))
    info, _ = choose_device(manifest, None)
    return manifest, Session(manifest, info, pipeline_submodules(manifest, Text2Image))


def embeddings(files):
    one, three = files
    return [load_embedding(one, "<xl-cat>"), load_embedding(three, "<xl-style>")]


def reference_pipe(model_dir, files):
    import diffusers
    from safetensors.torch import load_file

    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(
        model_dir, add_watermarker=False, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    cls_name, overrides = DIFFUSERS_SCHEDULERS["euler"]
    pipe.scheduler = getattr(diffusers, cls_name).from_config(pipe.scheduler.config, **overrides)
    for path, token in zip(files, ("<xl-cat>", "<xl-style>"), strict=True):
        sd = load_file(str(path))
        pipe.load_textual_inversion(
            sd["clip_l"], token=token, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer
        )
        pipe.load_textual_inversion(
            sd["clip_g"], token=token, text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2
        )
    return pipe


def test_both_text_encoders_match_diffusers(compiled_sdxl, session, files):
    manifest, session = session
    pipe = reference_pipe(compiled_sdxl.model, files)
    encoders = (
        ("text_encoder", pipe.tokenizer, pipe.text_encoder),
        ("text_encoder_2", pipe.tokenizer_2, pipe.text_encoder_2),
    )
    for i, (sub, tokenizer, model) in enumerate(encoders):
        inputs = TextInputs.for_artifact(manifest, embeddings(files), encoder=i)
        decl = session.decl(sub, "encode")
        for prompt in (PROMPT, NEGATIVE, "a photo of a cat"):
            enc = inputs.encode(prompt)
            hidden, pooled = session.call(sub, "encode", *inputs.arguments(enc, decl))
            ids = tokenizer(
                pipe.maybe_convert_prompt(prompt, tokenizer),
                padding="max_length",
                max_length=77,
                truncation=True,
                return_tensors="pt",
            ).input_ids
            assert (enc.ids >= inputs.base).any() == ("<" in prompt), (sub, prompt)
            first_eos = int(np.flatnonzero(enc.ids == inputs.tokenizer.eos_id)[0])
            # the second (eos_token_id 2) pools where transformers does: at the largest id,
            # the embedding's last token where the prompt calls one
            moved = i == 1 and "<" in prompt
            assert (enc.eos_index != first_eos) == moved, (sub, prompt)
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            want = out.hidden_states[-2][0].numpy()  # SDXL: the penultimate layer's
            want_pooled = (out.text_embeds if i else out.pooler_output)[0].numpy()
            scale = np.abs(want).max()
            assert np.abs(hidden[0] - want).max() <= 1e-5 * scale, (sub, prompt)
            assert np.abs(pooled[0] - want_pooled).max() <= 1e-5 * np.abs(want_pooled).max(), (
                sub,
                prompt,
            )


def sdiree_image(manifest, session, embs, seed):
    inputs = [TextInputs.for_artifact(manifest, embs, encoder=i) for i in range(2)]
    pipe = Text2Image(manifest, session, inputs)
    req = resolve_request(
        manifest, GenerationRequest(PROMPT, NEGATIVE, STEPS, 7.5, "euler", seed, 1)
    )
    result = pipe.generate(req, progress=None)
    return to_uint8(result.images), result


def test_image_matches_diffusers_load_textual_inversion(compiled_sdxl, session, files):
    manifest, session = session
    ours, result = sdiree_image(manifest, session, embeddings(files), 42)
    assert [e.name for e in result.embeddings] == ["<xl-cat>", "<xl-style>"]
    pipe = reference_pipe(compiled_sdxl.model, files)
    ref = pipe(
        PROMPT,
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        generator=torch.Generator("cpu").manual_seed(42),
        height=64,
        width=64,
        output_type="np",
    ).images
    ref = (ref * 255).round().astype(np.uint8)
    match = psnr(ours, ref)
    assert match >= 40.0
    # the embeddings change the image well beyond the parity's noise (the tiny random SDXL's
    # images depend little on the text: ~36 dB between prompts)
    plain, _ = sdiree_image(manifest, session, [], 42)
    print(
        f"SDXL TI: sdiree vs diffusers {match:.1f} dB; without the embeddings {psnr(plain, ref):.1f} dB"
    )
    assert psnr(plain, ref) <= match - 5.0, (psnr(plain, ref), match)


def test_embedding_of_the_other_family_is_one_line(compiled_sdxl, files, tmp_path):
    one, _ = files
    sd1 = tmp_path / "sd1-cat.safetensors"
    safetensors_torch.save_file({"emb_params": torch.ones(1, 32)}, sd1)
    # an SD 1.x/2.x embedding on the SDXL artifact: `sdiree run` says so, nothing written
    art = compiled_sdxl.get("cpu", "host", "fp32")
    out = tmp_path / "x.png"
    proc = subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "run", str(art), "--prompt", "a sd1-cat",
         "--embedding", str(sd1), "--steps", "2", "-o", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1, proc.stderr
    assert "holds one set of vectors (an SD 1.x/2.x embedding)" in lines[0]
    assert "this SDXL model's text encoders each take their own (clip_l, clip_g)" in lines[0]
    assert not out.exists()
    # an SDXL embedding on an SD 1.x/2.x model's text encoder (its one vector set)
    tokenizer = ClipTokenizer.from_dir(compiled_sdxl.model / "tokenizer")
    table = np.zeros((tokenizer.vocab_size, 32), np.float32)
    with pytest.raises(UserError) as e:
        TextInputs(tokenizer, table, [load_embedding(one)], model="SD 1.x")
    msg = str(e.value)
    assert "\n" not in msg
    assert "is an SDXL embedding (clip_l/clip_g vectors), but this is an SD 1.x model" in msg


def test_sdxl_embedding_files_checked(tmp_path):
    def save(name, tensors):
        path = tmp_path / name
        safetensors_torch.save_file(tensors, path)
        return path

    emb = load_embedding(
        save("ok.safetensors", {"clip_l": torch.ones(2, 8), "clip_g": torch.ones(2, 12)})
    )
    assert emb.per_encoder["clip_g"].shape == (2, 12) and emb.vectors.shape == (2, 8)
    assert emb.words == (("ok", True), ("<ok>", False))  # A1111's: the file's stem
    cases = {
        "half.safetensors": ({"clip_g": torch.ones(2, 12)}, "has clip_g vectors but no clip_l"),
        "counts.safetensors": (
            {"clip_l": torch.ones(2, 8), "clip_g": torch.ones(3, 12)},
            "differ in count",
        ),
        "nan.safetensors": (
            {"clip_l": torch.ones(1, 8), "clip_g": torch.full((1, 12), float("nan"))},
            "(clip_g) holds NaN",
        ),
    }
    for name, (tensors, says) in cases.items():
        with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")) as e:
            load_embedding(save(name, tensors))
        assert "\n" not in str(e.value)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((tmp_path / "ok.safetensors").read_bytes()[:-7])
    with pytest.raises(UserError, match="truncated"):
        load_embedding(cut)
