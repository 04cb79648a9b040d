"""The target registry: specs/targets.json read into typed records.

Targets, their arch presets, flags, export choices and tuning specs are data; this module only
reads and validates them. Both sides use it: compile for flags, run for drivers and arch checks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .cpu_features import host_cpu_features
from .errors import UserError

SCHEMA_VERSION = 1
DTYPES = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Arch:
    name: str
    description: str
    flags: tuple[str, ...]
    device_match: tuple[str, ...] = ()
    cpu_emulated: bool = False
    refused_dtypes: dict[str, str] = field(default_factory=dict)  # dtype -> why
    # cpu presets: the chip's features (/proc/cpuinfo names), or "host" for the compiling machine's
    cpu_features: tuple[str, ...] | str = ()

    def features(self) -> frozenset[str]:
        if self.cpu_features == "host":
            return host_cpu_features()
        return frozenset(self.cpu_features)

    def matches_device(self, device_name: str) -> bool:
        return any(re.search(p, device_name, re.IGNORECASE) for p in self.device_match)


@dataclass(frozen=True)
class DtypeOption:
    """A dtype computed differently from how it is stored: e.g. cpu bf16 keeps an fp32 model and
    fp32 weights, and compiles its matmuls with bf16 inputs and fp32 accumulation."""

    export_dtype: str  # dtype of the exported model, its inputs/outputs and parameter archives
    flags: tuple[str, ...] = ()
    # {cpu feature: flags added when the arch's CPU lacks it}, e.g. no bf16 matmul ukernel
    flags_if_cpu_lacks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # {submodule: flags} for this dtype, after (so overriding) the target's submodule_flags
    submodule_flags: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    driver: str
    default_dtype: str
    dtypes: tuple[str, ...]
    default_arch: str
    export: dict
    flags: tuple[str, ...]
    submodule_flags: dict[str, tuple[str, ...]]
    tuning_specs: dict[str, str]
    arches: dict[str, Arch] = field(default_factory=dict)
    dtype_options: dict[str, DtypeOption] = field(default_factory=dict)
    refused_dtypes: dict[str, str] = field(default_factory=dict)  # dtype -> why, every arch
    # Precompute load-time weight transforms at compile (compile/param_encoder.py).
    encode_parameters: bool = False
    submodule_export: dict[str, dict] = field(default_factory=dict)  # submodule -> overrides

    def export_for(self, submodule: str) -> dict:
        """The export choices of one submodule: the target's, with its overrides on top."""
        return {**self.export, **self.submodule_export.get(submodule, {})}

    def refusals(self, arch: str) -> dict[str, str]:
        """Dtypes that compile wrong or not at all for this arch, with the reason."""
        return {**self.refused_dtypes, **self.arch(arch).refused_dtypes}

    def usable_dtypes(self, arch: str) -> tuple[str, ...]:
        refused = self.refusals(arch)
        return tuple(d for d in self.dtypes if d not in refused)

    def pick_dtype(self, arch: str, requested: str | None) -> str:
        """The requested dtype, or the target's default (else the first usable one) for arch."""
        refused = self.refusals(arch)
        if requested is None:
            if self.default_dtype not in refused:
                return self.default_dtype
            return self.usable_dtypes(arch)[0]
        if requested in refused:
            raise UserError(
                f"--dtype {requested} is refused for {self.name}/{arch}: {refused[requested]}"
            )
        if requested not in self.dtypes:
            raise UserError(
                f"dtype {requested} is not available for {self.name}: use "
                f"{', '.join(self.usable_dtypes(arch))}"
            )
        return requested

    def export_dtype(self, dtype: str) -> str:
        opt = self.dtype_options.get(dtype)
        return opt.export_dtype if opt else dtype

    def missing_cpu_features(self, dtype: str, arch: str) -> tuple[str, ...]:
        """The CPU features a dtype option has fallback flags for that arch's CPU lacks."""
        opt = self.dtype_options.get(dtype)
        if not opt or not opt.flags_if_cpu_lacks:
            return ()
        have = self.arch(arch).features()
        return tuple(f for f in opt.flags_if_cpu_lacks if f not in have)

    def dtype_flags(self, dtype: str, arch: str) -> tuple[str, ...]:
        """Flags of a dtype option, with those for features arch's CPU lacks."""
        opt = self.dtype_options.get(dtype)
        if not opt:
            return ()
        missing = self.missing_cpu_features(dtype, arch)
        return (*opt.flags, *(f for feat in missing for f in opt.flags_if_cpu_lacks[feat]))

    def compile_flags(self, arch: str, dtype: str, submodule: str | None = None) -> list[str]:
        """iree-compile flags in the order that lets later ones override earlier ones: the
        target's, the arch preset's, the dtype's, the submodule's, the dtype's for the submodule."""
        opt = self.dtype_options.get(dtype)
        return [
            *self.flags,
            *self.arch(arch).flags,
            *self.dtype_flags(dtype, arch),
            *self.submodule_flags.get(submodule, ()),
            *(opt.submodule_flags.get(submodule, ()) if opt else ()),
        ]

    def arch(self, name: str) -> Arch:
        if name not in self.arches:
            raise UserError(
                f"unknown arch '{name}' for target {self.name}: choose one of "
                f"{', '.join(self.arches)}" + (" or auto" if self.default_arch == "auto" else "")
            )
        return self.arches[name]


@dataclass(frozen=True)
class Registry:
    specs_dir: Path
    targets: dict[str, Target]

    def target(self, name: str) -> Target:
        if name not in self.targets:
            raise UserError(f"unknown target '{name}': choose one of {', '.join(self.targets)}")
        return self.targets[name]

    def spec_path(self, relative: str) -> Path:
        return self.specs_dir / relative


def _tuples(d: dict) -> dict[str, tuple[str, ...]]:
    """A registry {name: [flags]} map with tuples for values."""
    return {k: tuple(v) for k, v in d.items()}


def _cpu_features(value) -> tuple[str, ...] | str:
    return "host" if value == "host" else tuple(value)


def default_specs_dir() -> Path:
    return Path(str(resources.files("sdiree.specs")))


def load_registry(specs_dir: Path | None = None) -> Registry:
    """Read targets.json from specs_dir (default: the shipped specs)."""
    specs_dir = Path(specs_dir) if specs_dir else default_specs_dir()
    path = specs_dir / "targets.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no targets.json in specs directory {specs_dir}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); fix or restore it") from None
    if data.get("schema_version") != SCHEMA_VERSION:
        raise UserError(
            f"{path} has schema_version {data.get('schema_version')}, this sdiree reads "
            f"{SCHEMA_VERSION}"
        )
    targets = {}
    for name, t in data["targets"].items():
        arches = {
            a: Arch(
                name=a,
                description=spec.get("description", ""),
                flags=tuple(spec.get("flags", ())),
                device_match=tuple(spec.get("device_match", ())),
                cpu_emulated=bool(spec.get("cpu_emulated", False)),
                refused_dtypes=dict(spec.get("refused_dtypes", {})),
                cpu_features=_cpu_features(spec.get("cpu_features", ())),
            )
            for a, spec in t["arches"].items()
        }
        targets[name] = Target(
            name=name,
            description=t.get("description", ""),
            driver=t["driver"],
            default_dtype=t["default_dtype"],
            dtypes=tuple(t.get("dtypes", DTYPES)),
            default_arch=t["default_arch"],
            export=dict(t.get("export", {})),
            flags=tuple(t.get("flags", ())),
            submodule_flags=_tuples(t.get("submodule_flags", {})),
            tuning_specs=dict(t.get("tuning_specs", {})),
            arches=arches,
            dtype_options={
                d: DtypeOption(
                    export_dtype=o["export_dtype"],
                    flags=tuple(o.get("flags", ())),
                    flags_if_cpu_lacks=_tuples(o.get("flags_if_cpu_lacks", {})),
                    submodule_flags=_tuples(o.get("submodule_flags", {})),
                )
                for d, o in t.get("dtype_options", {}).items()
            },
            refused_dtypes=dict(t.get("refused_dtypes", {})),
            encode_parameters=bool(t.get("encode_parameters", False)),
            submodule_export={k: dict(v) for k, v in t.get("submodule_export", {}).items()},
        )
    return Registry(specs_dir=specs_dir, targets=targets)
