"""Every scheduler's img2img and inpainting surface against diffusers: the strength's schedule
(``start_at_strength`` = the pipelines' ``get_timesteps`` + ``set_begin_index``), ``add_noise``
at its first timestep, and the loop from there with inpainting's re-noising after each step
(``add_noise`` at the next timestep once stepping has begun)."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import REFERENCE, TorchNoise, fake_unet, torch

STRENGTHS = (0.3, 0.6, 0.75, 1.0)
SHAPE = (2, 4, 8, 8)


def _diffusers_start(ref, steps: int, strength: float):
    """StableDiffusionImg2ImgPipeline.get_timesteps, as the pipeline calls it."""
    init = min(int(steps * strength), steps)
    t_start = max(steps - init, 0)
    timesteps = ref.timesteps[t_start * ref.order :]
    if hasattr(ref, "set_begin_index"):
        ref.set_begin_index(t_start * ref.order)
    return timesteps


def _inputs():
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal(SHAPE, dtype=np.float32)
    noise = rng.standard_normal(SHAPE, dtype=np.float32)
    return x0, noise


@pytest.mark.parametrize("strength", STRENGTHS)
@pytest.mark.parametrize("name", list(REFERENCE))
def test_strength_schedule_and_first_noise(name, strength, sd_config, make_pair):
    ours, ref = make_pair(name, sd_config)
    steps = 4 if name == "lcm" else 20
    ours.set_timesteps(steps)
    ref.set_timesteps(steps)
    timesteps = ours.start_at_strength(steps, strength)
    ref_timesteps = _diffusers_start(ref, steps, strength)
    np.testing.assert_array_equal(timesteps, ref_timesteps.numpy())
    x0, noise = _inputs()
    got = ours.add_noise(x0, noise, timesteps[0])
    want = ref.add_noise(torch.from_numpy(x0), torch.from_numpy(noise), ref_timesteps[:1].repeat(2))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strength", [0.5, 1.0])
@pytest.mark.parametrize("name", list(REFERENCE))
def test_inpainting_loop_matches(name, strength, sd_config, make_pair):
    """The 4-channel inpainting loop: step, then blend with the image latents re-noised at the
    next timestep (a fixed half-and-half mask), as StableDiffusionInpaintPipeline does."""
    ours, ref = make_pair(name, sd_config)
    steps = 4 if name == "lcm" else 12
    ours.set_timesteps(steps)
    ref.set_timesteps(steps)
    timesteps = ours.start_at_strength(steps, strength)
    ref_timesteps = _diffusers_start(ref, steps, strength)
    x0, noise = _inputs()
    mask = np.zeros(SHAPE, np.float32)
    mask[..., :4] = 1
    latents = ours.add_noise(x0, noise, timesteps[0])
    ref_latents = ref.add_noise(
        torch.from_numpy(x0), torch.from_numpy(noise), ref_timesteps[:1].repeat(2)
    )
    gen, ref_gen = TorchNoise(3), torch.Generator("cpu").manual_seed(3)
    kwargs = {"generator": ref_gen} if name in ("euler-a", "lcm") else {}
    tmask = torch.from_numpy(mask)
    for i, (t, ref_t) in enumerate(zip(timesteps, ref_timesteps, strict=True)):
        eps = fake_unet(ours.scale_model_input(latents, t), t)
        latents = ours.step(eps, t, latents, gen)
        ref_in = ref.scale_model_input(ref_latents, ref_t)
        ref_eps = torch.from_numpy(fake_unet(ref_in.numpy(), float(ref_t)))
        ref_latents = ref.step(ref_eps, ref_t, ref_latents, **kwargs).prev_sample
        proper, ref_proper = x0, torch.from_numpy(x0)
        if i < len(timesteps) - 1:
            proper = ours.add_noise(x0, noise, timesteps[i + 1])
            ref_proper = ref.add_noise(
                ref_proper, torch.from_numpy(noise), torch.tensor([ref_timesteps[i + 1]])
            )
        latents = (1 - mask) * proper + mask * latents
        ref_latents = (1 - tmask) * ref_proper + tmask * ref_latents
        want = ref_latents.numpy()
        np.testing.assert_allclose(
            latents, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()), err_msg=f"step {i}"
        )


def test_a_strength_that_leaves_no_step_gives_no_timesteps(make_pair, sd15):
    ours, _ = make_pair("euler", sd15)
    ours.set_timesteps(10)
    assert len(ours.start_at_strength(10, 0.09)) == 0
    assert len(ours.start_at_strength(10, 0.1)) == 1
    # 0.7 * 10 is 7.000000000000001 in floats: 7 steps, as diffusers truncates it
    assert len(ours.start_at_strength(10, 0.7)) == 7
