"""The target registry: specs/targets.json read into typed records.

Targets, their arch presets, flags, export choices and tuning specs are data; this module only
reads them, after runtime/registry_schema.py has checked every field. Both sides use it:
compile for flags, run for drivers and arch checks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .cpu_features import host_cpu_features
from .errors import UserError
from .registry_schema import DTYPES, check_registry

SCHEMA_VERSION = 1


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
    # vulkan presets: what a device must offer to run this preset's modules (runtime/vulkan_caps.py)
    device: dict = field(default_factory=dict)
    # {submodule or "*": spec}, used instead of the target's
    tuning_specs: dict[str, str] = field(default_factory=dict)
    # export choices for this chip, over the target's and its submodules' (a null drops one)
    export: dict = field(default_factory=dict)
    # vulkan: rewrite iree's cooperative-matrix shaders to multiply f16 matrices, not f32 copies
    # (compile/spirv_f16_operands.py); no preset sets it yet: untried on a GPU
    f16_matrix_operands: bool = False

    def features(self) -> frozenset[str]:
        if self.cpu_features == "host":
            return host_cpu_features()
        return frozenset(self.cpu_features)

    def matches_device(self, device_name: str) -> bool:
        return any(re.search(p, device_name, re.IGNORECASE) for p in self.device_match)


@dataclass(frozen=True)
class CpuLack:
    """What a dtype option changes, per submodule, when the arch's CPU lacks a feature (under
    `if_cpu_lacks`) or has one (under `if_cpu_has`)."""

    # {submodule: spec}: a preprocessing transform spec
    # (`--iree-preprocessing-transform-spec-filename`)
    preprocessing_specs: dict[str, str] = field(default_factory=dict)
    # {submodule: spec}: a tuning spec, before any other the submodule has
    tuning_specs: dict[str, str] = field(default_factory=dict)
    # {submodule: export choices} over every other (a null value drops a choice)
    submodule_export: dict[str, dict] = field(default_factory=dict)
    # {submodule: flags} after every other flag of the submodule (so overriding them)
    submodule_flags: dict[str, tuple[str, ...]] = field(default_factory=dict)


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
    # {submodule: export choices} for this dtype, over the target's; a null value drops the
    # choice (e.g. cpu bf16 turns Winograd F(4x4) off: its transforms cost bf16 10x the error)
    submodule_export: dict[str, dict] = field(default_factory=dict)
    # {cpu feature: note} said at compile when the arch's CPU has it (e.g. bf16 slower there)
    notes_if_cpu_has: dict[str, str] = field(default_factory=dict)
    # {submodule or "*": spec} for this dtype, before the target's (an arch preset's come first)
    tuning_specs: dict[str, str] = field(default_factory=dict)
    # {cpu feature: CpuLack}: what changes when the arch's CPU lacks the feature (e.g. cpu fp32
    # without avx512f: AVX2's f32 tiles)
    if_cpu_lacks: dict[str, CpuLack] = field(default_factory=dict)
    # {cpu feature: CpuLack}: what changes when the arch's CPU has the feature (e.g. cpu bf16 with
    # AMX: the UNet's linears on sdiree's AMX kernel), after the if_cpu_lacks changes
    if_cpu_has: dict[str, CpuLack] = field(default_factory=dict)


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
    # how a tuning spec reaches iree-compile: "flag" (--iree-codegen-tuning-spec-path) or
    # "module-attribute" (attached to the module: compile/tuning_embed.py)
    tuning_spec_via: str = "flag"
    dtype_options: dict[str, DtypeOption] = field(default_factory=dict)
    refused_dtypes: dict[str, str] = field(default_factory=dict)  # dtype -> why, every arch
    # Precompute load-time weight transforms at compile (compile/param_encoder.py).
    encode_parameters: bool = False
    # Where the encoder runs, when not on the target's own device: the IREE driver and the
    # iree-compile flags of the encoder module (GPU targets: the host CPU, so that compiling
    # needs no GPU and a moved artifact still re-encodes `--weights` on any x86-64 CPU).
    encoder_driver: str | None = None
    encoder_flags: tuple[str, ...] = ()
    submodule_export: dict[str, dict] = field(default_factory=dict)  # submodule -> overrides

    def export_for(self, submodule: str, dtype: str | None = None, arch: str | None = None) -> dict:
        """The export choices of one submodule: the target's, with the submodule's overrides,
        then the arch preset's, then the dtype option's for it on top (a null override drops a
        choice)."""
        opt = self.dtype_options.get(dtype) if dtype else None
        choices = {
            **self.export,
            **self.submodule_export.get(submodule, {}),
            **(self.arches[arch].export if arch in self.arches else {}),
            **(opt.submodule_export.get(submodule, {}) if opt else {}),
        }
        if dtype and arch in self.arches:
            for case in self.cpu_cases(dtype, arch):
                choices.update(case.submodule_export.get(submodule, {}))
        return {k: v for k, v in choices.items() if v is not None}

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

    def cpu_notes(self, dtype: str, arch: str) -> tuple[str, ...]:
        """The dtype option's notes for features the arch's CPU has."""
        opt = self.dtype_options.get(dtype)
        if not opt or not opt.notes_if_cpu_has:
            return ()
        have = self.arch(arch).features()
        return tuple(n for f, n in opt.notes_if_cpu_has.items() if f in have)

    def cpu_lacks(self, dtype: str, arch: str) -> tuple[CpuLack, ...]:
        """The dtype option's changes for the features arch's CPU lacks, in registry order."""
        opt = self.dtype_options.get(dtype)
        if not opt or not opt.if_cpu_lacks:
            return ()
        have = self.arch(arch).features()
        return tuple(lack for f, lack in opt.if_cpu_lacks.items() if f not in have)

    def cpu_cases(self, dtype: str, arch: str) -> tuple[CpuLack, ...]:
        """cpu_lacks, then the dtype option's changes for the features arch's CPU has."""
        opt = self.dtype_options.get(dtype)
        if not opt or not opt.if_cpu_has:
            return self.cpu_lacks(dtype, arch)
        have = self.arch(arch).features()
        return (
            *self.cpu_lacks(dtype, arch),
            *(case for f, case in opt.if_cpu_has.items() if f in have),
        )

    def preprocessing_spec(self, dtype: str, arch: str, submodule: str) -> str | None:
        """The registry-relative preprocessing spec a submodule compiles with for arch's CPU: the
        dtype option's for the first feature that CPU lacks (or has) which names one for
        submodule."""
        for case in self.cpu_cases(dtype, arch):
            if submodule in case.preprocessing_specs:
                return case.preprocessing_specs[submodule]
        return None

    def cpu_tuning_spec(self, dtype: str, arch: str, submodule: str) -> str | None:
        """The registry-relative tuning spec a submodule compiles with for arch's CPU, before any
        other: the dtype option's for the first feature that CPU lacks (or has) which names
        one."""
        for case in self.cpu_cases(dtype, arch):
            if submodule in case.tuning_specs:
                return case.tuning_specs[submodule]
        return None

    def dtype_flags(self, dtype: str, arch: str) -> tuple[str, ...]:
        """Flags of a dtype option, with those for features arch's CPU lacks."""
        opt = self.dtype_options.get(dtype)
        if not opt:
            return ()
        missing = self.missing_cpu_features(dtype, arch)
        return (*opt.flags, *(f for feat in missing for f in opt.flags_if_cpu_lacks[feat]))

    def compile_flags(self, arch: str, dtype: str, submodule: str | None = None) -> list[str]:
        """iree-compile flags in the order that lets later ones override earlier ones: the
        target's, the arch preset's, the dtype's, the submodule's, the dtype's for the submodule,
        those of the dtype's changes for the features arch's CPU lacks or has (cpu_cases)."""
        opt = self.dtype_options.get(dtype)
        cases = self.cpu_cases(dtype, arch) if submodule and opt else ()
        return [
            *self.flags,
            *self.arch(arch).flags,
            *self.dtype_flags(dtype, arch),
            *self.submodule_flags.get(submodule, ()),
            *(opt.submodule_flags.get(submodule, ()) if opt else ()),
            *(f for case in cases for f in case.submodule_flags.get(submodule, ())),
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


def _cpu_cases(spec: dict) -> dict[str, CpuLack]:
    return {
        f: CpuLack(
            preprocessing_specs=dict(case.get("preprocessing_specs", {})),
            tuning_specs=dict(case.get("tuning_specs", {})),
            submodule_export={k: dict(v) for k, v in case.get("submodule_export", {}).items()},
            submodule_flags=_tuples(case.get("submodule_flags", {})),
        )
        for f, case in spec.items()
    }


def default_specs_dir() -> Path:
    return Path(str(resources.files("sdiree.specs")))


def load_registry(specs_dir: Path | None = None) -> Registry:
    """Read targets.json from specs_dir (default: the shipped specs), checking every field."""
    specs_dir = Path(specs_dir) if specs_dir else default_specs_dir()
    path = specs_dir / "targets.json"
    if not specs_dir.is_dir():
        raise UserError(f"specs directory {specs_dir} does not exist; check --specs")
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise UserError(
            f"no targets.json in specs directory {specs_dir}; --specs takes a copy of the "
            "shipped specs/ directory"
        ) from None
    except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError, unreadable
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path} is not valid JSON ({why}); fix or restore it") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object; restore it")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise UserError(
            f"{path} has schema_version {data.get('schema_version')}, this sdiree reads "
            f"{SCHEMA_VERSION}"
        )
    check_registry(data, path)
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
                device=dict(spec.get("device", {})),
                tuning_specs=dict(spec.get("tuning_specs", {})),
                export=dict(spec.get("export", {})),
                f16_matrix_operands=bool(spec.get("f16_matrix_operands", False)),
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
            tuning_spec_via=t.get("tuning_spec_via", "flag"),
            arches=arches,
            dtype_options={
                d: DtypeOption(
                    export_dtype=o["export_dtype"],
                    flags=tuple(o.get("flags", ())),
                    flags_if_cpu_lacks=_tuples(o.get("flags_if_cpu_lacks", {})),
                    submodule_flags=_tuples(o.get("submodule_flags", {})),
                    submodule_export=dict(o.get("submodule_export", {})),
                    notes_if_cpu_has=dict(o.get("notes_if_cpu_has", {})),
                    tuning_specs=dict(o.get("tuning_specs", {})),
                    if_cpu_lacks=_cpu_cases(o.get("if_cpu_lacks", {})),
                    if_cpu_has=_cpu_cases(o.get("if_cpu_has", {})),
                )
                for d, o in t.get("dtype_options", {}).items()
            },
            refused_dtypes=dict(t.get("refused_dtypes", {})),
            encode_parameters=bool(t.get("encode_parameters", False)),
            encoder_driver=t.get("encoder", {}).get("driver"),
            encoder_flags=tuple(t.get("encoder", {}).get("flags", ())),
            submodule_export={k: dict(v) for k, v in t.get("submodule_export", {}).items()},
        )
    return Registry(specs_dir=specs_dir, targets=targets)
