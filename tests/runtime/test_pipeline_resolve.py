"""resolve_request: scheduler names and aliases, and step counts refused before any work, with
one line that names the limit. Torch-free: only a manifest and a scheduler config."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from make_tiny_sd import SD15_SCHEDULER_CONFIG  # tools/ is on sys.path (tests/conftest.py)

from sdiree.runtime import schedulers
from sdiree.runtime.errors import UserError
from sdiree.runtime.manifest import Manifest
from sdiree.runtime.pipeline import GenerationRequest, resolve_request

SD15 = {"_class_name": "PNDMScheduler", **SD15_SCHEDULER_CONFIG}
CONFIGS = {
    "sd15": SD15,
    "cos": {**SD15, "beta_schedule": "squaredcos_cap_v2"},
    "zero-snr-vpred-trailing": {
        **SD15,
        "rescale_betas_zero_snr": True,
        "prediction_type": "v_prediction",
        "timestep_spacing": "trailing",
    },
}


def manifest_with(tmp_path, config: dict) -> Manifest:
    (tmp_path / "scheduler").mkdir(exist_ok=True)
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    image = {"width": 64, "height": 64, "batch_size": 1}
    data = {"image": image, "scheduler": {"config": "scheduler/scheduler_config.json"}}
    return Manifest(tmp_path, data)


def resolve(tmp_path, config=SD15, **request) -> GenerationRequest:
    return resolve_request(manifest_with(tmp_path, config), GenerationRequest("x", **request))


def refusal(tmp_path, config=SD15, **request) -> str:
    with pytest.raises(UserError) as info:
        resolve(tmp_path, config, **request)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("Euler a", "euler-a"),
        ("euler_ancestral", "euler-a"),
        ("k_euler_a", "euler-a"),
        ("EULER-A", "euler-a"),
        ("Euler", "euler"),
        ("DPM++ 2M", "dpmpp-2m"),
        ("dpmpp_2m", "dpmpp-2m"),
        ("dpm++2m", "dpmpp-2m"),
        ("DPM++ 2M Karras", "dpmpp-2m-karras"),
        ("dpmpp_2m_karras", "dpmpp-2m-karras"),
        ("PLMS", "pndm"),
        ("pndm", "pndm"),
        ("DDIM", "ddim"),
        ("k_lms", "lms"),
        ("LCM", "lcm"),
        ("EulerAncestralDiscreteScheduler", "euler-a"),
    ],
)
def test_scheduler_aliases(tmp_path, alias, name):
    assert schedulers.resolve_name(alias) == name
    assert resolve(tmp_path, scheduler=alias).scheduler == name


def test_canonical_names_resolve_to_themselves():
    assert [schedulers.resolve_name(name) for name in schedulers.NAMES] == schedulers.NAMES


def test_choices_help_lists_every_name_and_alias():
    text = schedulers.choices_help()
    assert "\n" not in text
    for name in schedulers.NAMES:
        assert name in text
        assert all(alias in text for alias in schedulers.ALIASES[name])


def test_unknown_scheduler(tmp_path):
    message = refusal(tmp_path, scheduler="heun")
    assert "unknown scheduler 'heun'" in message
    assert all(name in message for name in schedulers.NAMES)
    with pytest.raises(ValueError, match="heun"):
        schedulers.resolve_name("heun")


def test_default_scheduler_is_the_models(tmp_path):
    req = resolve(tmp_path)
    assert (req.scheduler, req.steps) == ("pndm", 25)


@pytest.mark.parametrize(
    ("scheduler", "steps", "expected"),
    [
        (
            "euler",
            1001,
            "--steps 1001: this model's scheduler has 1000 training timesteps; use at most 1000",
        ),
        (
            "pndm",
            1001,
            "--steps 1001: this model's scheduler has 1000 training timesteps, of which pndm can "
            "take at most 999; use at most 999",
        ),
        ("lcm", 1001, "of which lcm can take at most 50; use at most 50"),
    ],
)
def test_steps_past_the_training_timesteps(tmp_path, scheduler, steps, expected):
    assert expected in refusal(tmp_path, scheduler=scheduler, steps=steps)


def test_huge_step_count_is_refused_at_once(tmp_path):
    start = time.perf_counter()
    message = refusal(tmp_path, scheduler="euler", steps=100_000_000_000)
    assert message.endswith("use at most 1000")
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    ("scheduler", "steps", "limit"),
    [("pndm", 1000, 999), ("ddim", 1000, 999), ("dpmpp-2m", 1000, 999), ("lcm", 51, 50)],
)
def test_steps_a_scheduler_cannot_take(tmp_path, scheduler, steps, limit):
    message = refusal(tmp_path, scheduler=scheduler, steps=steps)
    assert message.startswith(f"--steps {steps}: {scheduler} cannot take {steps} steps")
    assert message.endswith(f"use at most {limit}")
    assert resolve(tmp_path, scheduler=scheduler, steps=limit).steps == limit


def test_too_few_steps_for_the_config(tmp_path):
    # PNDM's class default (skip_prk_steps false) warms up with 3 Runge-Kutta steps.
    message = refusal(tmp_path, {"_class_name": "PNDMScheduler"}, steps=3)
    assert message.startswith("--steps 3: pndm cannot take 3 steps")
    assert "num_inference_steps >= 4" in message and "at most" not in message
    assert resolve(tmp_path, {"_class_name": "PNDMScheduler"}, steps=4).steps == 4


def test_config_the_scheduler_cannot_use(tmp_path):
    config = {**SD15, "use_exponential_sigmas": True}
    message = refusal(tmp_path, config, scheduler="euler")
    assert message.startswith("the euler scheduler cannot use this model's scheduler config")
    assert "use_exponential_sigmas" in message


class Noise:
    def __init__(self):
        self.rng = np.random.default_rng(0)

    def randn(self, shape):
        return self.rng.standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("name", schedulers.NAMES)
def test_what_resolves_runs(tmp_path, name, config_name):
    """Every step count is refused up front or runs to finite latents the way the pipeline
    drives the scheduler (from the first timestep)."""
    config = CONFIGS[config_name]
    for steps in (1, 2, 25, 50, 999, 1000, 1001):
        try:
            req = resolve(tmp_path, config, scheduler=name, steps=steps)
        except UserError:
            continue
        sched = schedulers.create(req.scheduler, config)
        sched.set_timesteps(req.steps)
        sched.set_begin_index(0)
        x = np.ones((1, 1, 2, 2), np.float32) * np.float32(sched.init_noise_sigma)
        with np.errstate(all="raise"):
            for t in sched.timesteps:
                eps = 0.5 * np.tanh(sched.scale_model_input(x, t))
                x = sched.step(eps, t, x, Noise())
        assert np.isfinite(x).all(), (name, steps)
