"""Numpy schedulers, one self-contained file each, plus a registry by command-line name.

``resolve_name`` also takes the names other tools use (AUTOMATIC1111's "Euler a", ComfyUI's
``euler_ancestral``, stable-diffusion.cpp's ``dpm++2m``, diffusers' class names), and
``max_steps`` says how many steps a scheduler can take with a model's config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .base import NoiseGenerator, Scheduler
from .ddim import DDIMScheduler
from .dpmpp_2m import DPMSolverMultistepScheduler
from .euler import EulerDiscreteScheduler
from .euler_ancestral import EulerAncestralDiscreteScheduler
from .lcm import LCMScheduler
from .lms import LMSDiscreteScheduler
from .pndm import PNDMScheduler

__all__ = [
    "ALIASES",
    "DEFAULT_STEPS",
    "NAMES",
    "SAMPLER_LABELS",
    "NoiseGenerator",
    "Scheduler",
    "choices_help",
    "create",
    "max_steps",
    "name_for_class",
    "name_for_config",
    "resolve_name",
]

NAMES = ["euler", "euler-a", "ddim", "pndm", "dpmpp-2m", "dpmpp-2m-karras", "lms", "lcm"]

# name -> (class, options forced on top of the loaded config)
_REGISTRY: dict[str, tuple[type[Scheduler], dict[str, Any]]] = {
    "euler": (EulerDiscreteScheduler, {}),
    "euler-a": (EulerAncestralDiscreteScheduler, {}),
    "ddim": (DDIMScheduler, {}),
    "pndm": (PNDMScheduler, {}),
    "dpmpp-2m": (DPMSolverMultistepScheduler, {"use_karras_sigmas": False}),
    "dpmpp-2m-karras": (DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
    "lms": (LMSDiscreteScheduler, {}),
    "lcm": (LCMScheduler, {}),
}

# Default inference steps: 25 everywhere but LCM. diffusers' pipeline default of 50 doubles the
# time for little visible gain on SD 1.5 (its own PLMS/PNDM scheduler included); LCM is
# distilled for 2-8 steps, so 4.
DEFAULT_STEPS = {
    "euler": 25,
    "euler-a": 25,
    "ddim": 25,
    "pndm": 25,
    "dpmpp-2m": 25,
    "dpmpp-2m-karras": 25,
    "lms": 25,
    "lcm": 4,
}

# AUTOMATIC1111 web UI sampler names.
SAMPLER_LABELS = {
    "euler": "Euler",
    "euler-a": "Euler a",
    "ddim": "DDIM",
    "pndm": "PLMS",
    "dpmpp-2m": "DPM++ 2M",
    "dpmpp-2m-karras": "DPM++ 2M Karras",
    "lms": "LMS",
    "lcm": "LCM",
}

# Other tools' names for the same samplers, as they spell them (shown in --help). Matching
# ignores case, spaces, "_" and "-", and reads "++" as "pp": "DPM++ 2M" = "dpmpp_2m" = "dpm++2m".
ALIASES = {
    "euler": ("Euler", "k_euler"),
    "euler-a": ("Euler a", "euler_ancestral", "euler_a", "k_euler_a", "k_euler_ancestral"),
    "ddim": ("DDIM",),
    "pndm": ("PLMS", "k_plms"),
    "dpmpp-2m": ("DPM++ 2M", "dpmpp_2m", "dpm++2m", "k_dpmpp_2m"),
    "dpmpp-2m-karras": ("DPM++ 2M Karras", "dpmpp_2m_karras", "dpmpp_2m_k", "k_dpmpp_2m_karras"),
    "lms": ("LMS", "k_lms"),
    "lcm": ("LCM",),
}

_CLASS_TO_NAME = {
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler-a",
    "DDIMScheduler": "ddim",
    "PNDMScheduler": "pndm",
    "DPMSolverMultistepScheduler": "dpmpp-2m",
    "LMSDiscreteScheduler": "lms",
    "LCMScheduler": "lcm",
}


def create(name: str, config: Mapping[str, Any] | None = None) -> Scheduler:
    """Build scheduler ``name`` from a diffusers scheduler_config.json dict.

    Like ``SchedulerClass.from_config(config)``: keys the class does not take are ignored, missing
    ones take that class's diffusers default. Options the name implies (e.g. Karras sigmas for
    "dpmpp-2m-karras") override the config.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown scheduler {name!r}; valid names: {', '.join(NAMES)}")
    cls, forced = _REGISTRY[name]
    return cls(config, **forced)


def name_for_class(class_name: str) -> str | None:
    """Our name for a diffusers scheduler class name, or None if there is no port of it.

    DPMSolverMultistepScheduler maps to "dpmpp-2m"; use name_for_config to see Karras sigmas.
    """
    return _CLASS_TO_NAME.get(class_name)


def name_for_config(config: Mapping[str, Any]) -> str | None:
    """Our name for a scheduler_config.json dict (its ``_class_name`` and relevant options).

    Returns None when the class has no port, or for DPMSolverMultistepScheduler configs that are
    not DPM++ 2M (another algorithm_type, solver_order or solver_type).
    """
    defaulted = set(config.get("_use_default_values") or ())
    config = {k: v for k, v in config.items() if k not in defaulted}
    name = name_for_class(str(config.get("_class_name", "")))
    if name == "dpmpp-2m":
        if (
            config.get("algorithm_type", "dpmsolver++") != "dpmsolver++"
            or config.get("solver_order", 2) != 2
            or config.get("solver_type", "midpoint") != "midpoint"
        ):
            return None
        if config.get("use_karras_sigmas"):
            return "dpmpp-2m-karras"
    return name


def _normalise(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.strip().lower()).replace("++", "pp")


_LOOKUP = {
    **{_normalise(class_name): name for class_name, name in _CLASS_TO_NAME.items()},
    **{_normalise(alias): name for name in NAMES for alias in (name, *ALIASES[name])},
}


def resolve_name(name: str) -> str:
    """Our name (one of NAMES) for a scheduler name or any alias in ALIASES, or a diffusers
    class name; ValueError (one line, listing the choices) for an unknown one."""
    found = _LOOKUP.get(_normalise(name))
    if found is None:
        raise ValueError(
            f"unknown scheduler {name!r}: choose one of {', '.join(NAMES)} (or a name from "
            "AUTOMATIC1111, ComfyUI or sd.cpp for one of them, e.g. 'Euler a', 'dpmpp_2m')"
        )
    return found


def choices_help() -> str:
    """One line for --help: every name with the other names it accepts."""
    return ", ".join(f"{name} ({', '.join(ALIASES[name])})" for name in NAMES)


def max_steps(name: str, config: Mapping[str, Any] | None = None, upto: int | None = None) -> int:
    """The most inference steps, at most ``upto`` (default: num_train_timesteps), that scheduler
    ``name`` can take with ``config``; 0 if none.

    Schedules are checked as set_timesteps builds them: LCM stops at original_inference_steps,
    DDIM/PNDM where a leading spacing's offset passes the last training timestep, DPM++ 2M and
    LMS where timesteps start to repeat. Counts past num_train_timesteps are never offered: the
    samplers that run them only repeat timesteps or step between training timesteps.
    """
    scheduler = create(name, config)
    limit = int(scheduler.config["num_train_timesteps"])
    if upto is not None:
        limit = min(limit, upto)
    for n in range(limit, 0, -1):
        try:
            scheduler.set_timesteps(n)
        except ValueError:
            continue
        return n
    return 0
