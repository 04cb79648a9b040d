"""Text2Image with more images than the compiled batch: the scheduler steps all images at once
(one noise draw per step for all of them, as diffusers draws it) and only the UNet runs in
chunks of the compiled batch. A fake session stands in for the compiled modules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_tokenizer  # tools/ is on sys.path (tests/conftest.py)
from make_tiny_sd import SD15_SCHEDULER_CONFIG

from sdiree.runtime import schedulers
from sdiree.runtime.manifest import FunctionDecl, Manifest, SubmoduleDecl, TensorDecl
from sdiree.runtime.pipeline import GenerationRequest, Text2Image, resolve_request
from sdiree.runtime.rng import TorchCPUGenerator
from sdiree.runtime.tokenizer import ClipTokenizer

LATENT = (4, 4, 4)  # channels, height, width
HIDDEN = 8
SEED = 1234
GUIDANCE = 7.5


def fake_text(ids: np.ndarray) -> np.ndarray:
    """Stand-in text encoder: [B, 77] ids -> [B, 77, HIDDEN] float32."""
    return np.sin(ids[..., None] * (0.01 * np.arange(1, HIDDEN + 1))).astype(np.float32)


def fake_unet(x: np.ndarray, t: float, text: np.ndarray) -> np.ndarray:
    """Stand-in UNet, row by row (so the result cannot depend on how rows are batched)."""
    shift = text.mean(axis=(1, 2)).reshape(-1, 1, 1, 1)
    return (0.5 * np.tanh(x) + np.float32(0.01 * t / 1000) * x + shift).astype(np.float32)


def fake_decode(latents: np.ndarray) -> np.ndarray:
    return np.tanh(latents[:, :3]).repeat(8, axis=2).repeat(8, axis=3)


class FakeSession:
    """Answers Text2Image's module calls at the compiled batch, checking the shapes it gets."""

    def __init__(self, batch: int):
        self.batch = batch
        self.unet_batches: list[int] = []

    def call(self, submodule: str, function: str, *args):
        b = self.batch
        if (submodule, function) == ("text_encoder", "encode"):
            (ids,) = args
            assert ids.shape == (b, 77)
            return fake_text(ids), None
        if submodule == "unet":
            x, t, text = args
            assert x.shape == (b, *LATENT) and t.shape == (1,)
            self.unet_batches.append(x.shape[0])
            if function == "denoise":
                assert text.shape[0] == b
                return (fake_unet(x, float(t[0]), text),)
            assert function == "denoise_cfg" and text.shape[0] == 2 * b
            halves = [fake_unet(x, float(t[0]), text[k * b : (k + 1) * b]) for k in (0, 1)]
            return (np.concatenate(halves),)
        if (submodule, function) == ("vae_decoder", "decode"):
            (latents,) = args
            assert latents.shape == (b, *LATENT)
            return (fake_decode(latents),)
        raise AssertionError(f"unexpected call {submodule}.{function}")


SD15 = {"_class_name": "PNDMScheduler", **SD15_SCHEDULER_CONFIG}


def write_artifact(root, config: dict):
    tiny_tokenizer.write_tiny_clip_tokenizer(root / "tokenizer")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def artifact_root(tmp_path_factory):
    return write_artifact(tmp_path_factory.mktemp("fake-artifact"), SD15)


def fake_manifest(root, batch: int) -> Manifest:
    c, h, w = LATENT
    sample = TensorDecl("sample", (batch, c, h, w), "float32")
    t = TensorDecl("timestep", (1,), "float32")

    def text(n):
        return TensorDecl("encoder_hidden_states", (n, 77, HIDDEN), "float32")

    unet = {
        "denoise": FunctionDecl("denoise", (sample, t, text(batch)), ()),
        "denoise_cfg": FunctionDecl("denoise_cfg", (sample, t, text(2 * batch)), ()),
    }
    data = {
        "image": {
            "height": 8 * h,
            "width": 8 * w,
            "batch_size": batch,
            "latent_channels": c,
            "latent_height": h,
            "latent_width": w,
        },
        "text_encoders": [{"tokenizer": "tokenizer"}],
        "scheduler": {"config": "scheduler/scheduler_config.json"},
    }
    ids = TensorDecl("input_ids", (batch, 77), "int64")  # a text encoder that takes ids
    encode = {"encode": FunctionDecl("encode", (ids,), ())}
    return Manifest(
        root,
        data,
        {
            "unet": SubmoduleDecl("unet", "unet.vmfb", None, None, unet),
            "text_encoder": SubmoduleDecl("text_encoder", "te.vmfb", None, None, encode),
        },
    )


def generate(root, batch: int, seed_offset: int = 0, **request) -> tuple[np.ndarray, FakeSession]:
    manifest = fake_manifest(root, batch)
    req = GenerationRequest(prompt="a red cube", seed=SEED + seed_offset, **request)
    req = resolve_request(manifest, req)
    session = FakeSession(batch)
    result = Text2Image(manifest, session).generate(req, progress=None)
    return result.images, session


def text_rows(root, guidance: float) -> tuple[np.ndarray, np.ndarray | None]:
    tok = ClipTokenizer.from_dir(root / "tokenizer")
    cond = fake_text(tok.encode("a red cube").ids[None, :].astype(np.int64))
    uncond = fake_text(tok.encode("").ids[None, :].astype(np.int64))
    return cond, (uncond if guidance > 1 else None)


def numpy_reference(root, name: str, steps: int, num_images: int, guidance: float) -> np.ndarray:
    """The loop over all images at once, noise drawn for all of them at each step."""
    config = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    cond, uncond = text_rows(root, guidance)
    generator = TorchCPUGenerator(SEED)
    latents = generator.randn((num_images, *LATENT))
    sched = schedulers.create(name, config)
    sched.set_timesteps(steps)
    sched.set_begin_index(0)
    latents = latents * np.float32(sched.init_noise_sigma)
    for t in sched.timesteps:
        x = sched.scale_model_input(latents, t)
        eps = fake_unet(x, float(t), cond)
        if uncond is not None:
            e_uncond = fake_unet(x, float(t), uncond)
            eps = e_uncond + np.float32(guidance) * (eps - e_uncond)
        latents = sched.step(eps, t, latents, generator)
    return fake_decode(latents)


CASES = [("euler-a", 5, GUIDANCE), ("euler-a", 3, 1.0), ("lcm", 4, GUIDANCE)]


@pytest.mark.parametrize(("name", "steps", "guidance"), CASES)
def test_images_do_not_depend_on_the_compiled_batch(artifact_root, name, steps, guidance):
    request = {"scheduler": name, "steps": steps, "guidance_scale": guidance, "num_images": 2}
    on_b1, s1 = generate(artifact_root, 1, **request)
    on_b2, s2 = generate(artifact_root, 2, **request)
    assert s1.unet_batches == [1] * (2 * steps)  # two chunks per step
    assert s2.unet_batches == [2] * steps
    np.testing.assert_array_equal(on_b1, on_b2)
    expected = numpy_reference(artifact_root, name, steps, 2, guidance)
    np.testing.assert_array_equal(on_b1, expected)
    # Two images drawn together are not one image drawn twice.
    assert not np.array_equal(on_b1[0], on_b1[1])


def test_padded_last_chunk(artifact_root):
    # 3 images on a batch-2 artifact: the second chunk is padded, its padding row dropped.
    request = {"scheduler": "euler-a", "steps": 4, "num_images": 3}
    on_b2, session = generate(artifact_root, 2, **request)
    on_b3, _ = generate(artifact_root, 3, **request)
    assert on_b2.shape == (3, 3, 32, 32)
    assert session.unet_batches == [2] * 8
    np.testing.assert_array_equal(on_b2, on_b3)
    expected = numpy_reference(artifact_root, "euler-a", 4, 3, GUIDANCE)
    np.testing.assert_array_equal(on_b2, expected)


def test_schedule_with_a_repeated_first_timestep(tmp_path):
    # DPM++ 2M Karras on the cosine schedule: its first timesteps round to the same value, so
    # looking the first one up (diffusers' default) starts at the second and runs off the end.
    root = write_artifact(tmp_path, {**SD15, "beta_schedule": "squaredcos_cap_v2"})
    images, session = generate(root, 1, scheduler="dpmpp-2m-karras", steps=25)
    assert session.unet_batches == [1] * 25
    np.testing.assert_array_equal(images, numpy_reference(root, "dpmpp-2m-karras", 25, 1, GUIDANCE))


@pytest.mark.parametrize(("name", "steps", "guidance"), CASES)
def test_per_image_seeds_remake_each_image_alone(artifact_root, name, steps, guidance):
    """With per-image seeds (what `sdiree run` uses), image i of a run is the one-image run of
    seed + i, whatever the compiled batch."""
    request = {"scheduler": name, "steps": steps, "guidance_scale": guidance}
    on_b1, _ = generate(artifact_root, 1, num_images=3, per_image_seeds=True, **request)
    on_b2, _ = generate(artifact_root, 2, num_images=3, per_image_seeds=True, **request)
    np.testing.assert_array_equal(on_b1, on_b2)
    for i in range(3):
        alone, _ = generate(
            artifact_root, 1, num_images=1, per_image_seeds=True, seed_offset=i, **request
        )
        np.testing.assert_array_equal(on_b1[i : i + 1], alone)


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
@pytest.mark.parametrize("per_image_seeds", [False, True], ids=["one-generator", "per-image"])
@pytest.mark.parametrize(("name", "steps", "guidance"), CASES)
def test_matches_diffusers_scheduler_with_a_torch_generator(
    artifact_root, name, steps, guidance, per_image_seeds
):
    """What diffusers' pipeline does for num_images_per_prompt=2 with one CPU generator, or with
    a list of two (seed, seed + 1)."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    from diffusers.utils.torch_utils import randn_tensor

    request = {"scheduler": name, "steps": steps, "guidance_scale": guidance, "num_images": 2}
    ours, _ = generate(artifact_root, 1, per_image_seeds=per_image_seeds, **request)

    config = json.loads((artifact_root / "scheduler" / "scheduler_config.json").read_text())
    class_name = type(schedulers.create(name, config)).CLASS_NAME
    sched = getattr(diffusers, class_name).from_config(config)
    sched.set_timesteps(steps)
    cond, uncond = text_rows(artifact_root, guidance)
    if per_image_seeds:
        generator = [torch.Generator("cpu").manual_seed(SEED + i) for i in range(2)]
    else:
        generator = torch.Generator("cpu").manual_seed(SEED)
    latents = randn_tensor((2, *LATENT), generator=generator) * sched.init_noise_sigma
    for t in sched.timesteps:
        x = sched.scale_model_input(latents, t).numpy()
        eps = fake_unet(x, float(t), cond)
        if uncond is not None:
            e_uncond = fake_unet(x, float(t), uncond)
            eps = e_uncond + np.float32(guidance) * (eps - e_uncond)
        latents = sched.step(torch.from_numpy(eps), t, latents, generator=generator).prev_sample
    expected = fake_decode(latents.numpy())
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
