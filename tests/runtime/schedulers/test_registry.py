"""Scheduler registry: names, labels, defaults, from_config semantics, and the torch-free rule."""

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import sdiree.runtime.schedulers as schedulers
from sdiree.runtime.schedulers import (
    DEFAULT_STEPS,
    NAMES,
    SAMPLER_LABELS,
    Scheduler,
    create,
    name_for_class,
    name_for_config,
)

ALL_NAMES = ["euler", "euler-a", "ddim", "pndm", "dpmpp-2m", "dpmpp-2m-karras", "lms", "lcm"]


def test_names_labels_and_defaults():
    assert NAMES == ALL_NAMES
    assert list(DEFAULT_STEPS) == ALL_NAMES
    assert all(isinstance(v, int) and v >= 1 for v in DEFAULT_STEPS.values())
    assert DEFAULT_STEPS["lcm"] == 4
    assert SAMPLER_LABELS == {
        "euler": "Euler",
        "euler-a": "Euler a",
        "ddim": "DDIM",
        "pndm": "PLMS",
        "dpmpp-2m": "DPM++ 2M",
        "dpmpp-2m-karras": "DPM++ 2M Karras",
        "lms": "LMS",
        "lcm": "LCM",
    }


def test_unknown_name():
    with pytest.raises(ValueError) as info:
        create("heun", {})
    message = str(info.value)
    assert "\n" not in message
    assert "heun" in message
    assert all(name in message for name in ALL_NAMES)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_api_surface(name, sd15):
    scheduler = create(name, sd15)
    assert isinstance(scheduler, Scheduler)
    params = list(inspect.signature(scheduler.step).parameters)
    assert params[:4] == ["model_output", "timestep", "sample", "generator"]
    scheduler.set_timesteps(DEFAULT_STEPS[name])
    assert isinstance(scheduler.init_noise_sigma, float)
    assert scheduler.timesteps.dtype.kind in "fi"
    with pytest.raises(ValueError):
        scheduler.set_timesteps(0)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(-3)
    with pytest.raises(ValueError):
        scheduler.set_timesteps(2.5)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_default_steps_loop_runs(name, sd15):
    scheduler = create(name, sd15)
    scheduler.set_timesteps(DEFAULT_STEPS[name])
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((1, 4, 4, 4), dtype=np.float32) * scheduler.init_noise_sigma

    class Noise:
        def randn(self, shape):
            return rng.standard_normal(shape, dtype=np.float32)

    for t in scheduler.timesteps:
        eps = 0.5 * np.tanh(scheduler.scale_model_input(latents, t))
        latents = scheduler.step(eps, t, latents, Noise())
    assert latents.dtype == np.float32
    assert np.isfinite(latents).all()


@pytest.mark.parametrize("name", ALL_NAMES)
def test_config_resolution_matches_from_config(name, sd_config, make_pair):
    """Shared keys are kept, everything else takes this class's defaults, like from_config."""
    ours, ref = make_pair(name, sd_config)
    for key, value in ours.config.items():
        assert key in ref.config, key
        assert value == ref.config[key], key


def test_use_default_values_and_unknown_keys(make_pair):
    config = {
        "_class_name": "EulerDiscreteScheduler",
        "_use_default_values": ["timestep_spacing"],
        "timestep_spacing": "leading",
        "beta_schedule": "scaled_linear",
        "some_future_option": 3,
    }
    ours, ref = make_pair("euler", config)
    assert ours.config["timestep_spacing"] == ref.config["timestep_spacing"] == "linspace"
    assert ours.config["beta_schedule"] == "scaled_linear"
    assert "some_future_option" not in ours.config


def test_name_for_class():
    assert name_for_class("PNDMScheduler") == "pndm"
    assert name_for_class("EulerDiscreteScheduler") == "euler"
    assert name_for_class("EulerAncestralDiscreteScheduler") == "euler-a"
    assert name_for_class("DDIMScheduler") == "ddim"
    assert name_for_class("DPMSolverMultistepScheduler") == "dpmpp-2m"
    assert name_for_class("LMSDiscreteScheduler") == "lms"
    assert name_for_class("LCMScheduler") == "lcm"
    assert name_for_class("HeunDiscreteScheduler") is None


def test_name_for_config(sd15):
    assert name_for_config(sd15) == "pndm"
    dpm = {"_class_name": "DPMSolverMultistepScheduler"}
    assert name_for_config(dpm) == "dpmpp-2m"
    assert name_for_config({**dpm, "use_karras_sigmas": True}) == "dpmpp-2m-karras"
    assert (
        name_for_config(
            {**dpm, "use_karras_sigmas": True, "_use_default_values": ["use_karras_sigmas"]}
        )
        == "dpmpp-2m"
    )
    assert name_for_config({**dpm, "algorithm_type": "sde-dpmsolver++"}) is None
    assert name_for_config({**dpm, "solver_order": 3}) is None
    assert name_for_config({}) is None
    for name in ALL_NAMES:
        assert name_for_config(create(name, sd15).config | {"_class_name": _class_of(name)}) == name


def _class_of(name):
    return type(create(name, {})).CLASS_NAME


def test_runtime_sources_never_import_torch():
    package_dir = Path(schedulers.__file__).parent
    forbidden = {"torch", "diffusers", "transformers", "scipy"}
    for path in sorted(package_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & forbidden, f"{path.name} imports {roots & forbidden}"


def test_import_and_run_without_torch():
    code = (
        "import sys, numpy as np\n"
        "from sdiree.runtime.schedulers import NAMES, create\n"
        "for name in NAMES:\n"
        "    s = create(name, {})\n"
        "    s.set_timesteps(4)\n"
        "    x = np.ones((1, 4, 2, 2), np.float32) * s.init_noise_sigma\n"
        "    for t in s.timesteps:\n"
        "        eps = np.tanh(s.scale_model_input(x, t))\n"
        "        x = s.step(eps, t, x)\n"
        "bad = sorted(m for m in ('torch', 'diffusers', 'transformers', 'scipy') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
