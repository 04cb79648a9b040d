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


# The fields targets.json may hold (specs/README.md explains them), with their JSON types.
# Keys that start with "_" are comments. "flag_map": {name: [strings]}; "str_map": {name: string};
# "obj_map": {name: object}.
def submodule_names() -> tuple[str, ...]:
    """Every submodule some family compiles (specs/families.json), in registry order."""
    from .families import load_families

    names: dict[str, None] = {}
    for fam in load_families().families.values():
        names.update(dict.fromkeys(fam.submodules or {}))
    return tuple(names)


TOP_FIELDS = {"schema_version": "int", "targets": "obj_map"}
TARGET_FIELDS = {
    "description": "str",
    "driver": "str",
    "default_dtype": "str",
    "dtypes": "strs",
    "default_arch": "str",
    "export": "dict",
    "flags": "strs",
    "submodule_flags": "flag_map",
    "submodule_export": "obj_map",
    "tuning_specs": "str_map",
    "arches": "obj_map",
    "dtype_options": "obj_map",
    "refused_dtypes": "str_map",
    "encode_parameters": "bool",
    "encoder": "dict",
    "tuning_spec_via": "str",
}
ENCODER_FIELDS = {"driver": "str", "flags": "strs"}
ARCH_FIELDS = {
    "description": "str",
    "flags": "strs",
    "device_match": "strs",
    "cpu_emulated": "bool",
    "refused_dtypes": "str_map",
    "cpu_features": "features",
    "device": "dict",
    "tuning_specs": "str_map",
    "export": "dict",
    "f16_matrix_operands": "bool",
}
# What a vulkan preset's modules need from a device (runtime/device_select.py checks them):
# vendor_ids ("0x1002", for --arch auto), subgroup_sizes (each must be one the device can run
# at), cooperative_matrix, shared_memory_bytes (the least the device must offer).
DEVICE_FIELDS = ("vendor_ids", "subgroup_sizes", "cooperative_matrix", "shared_memory_bytes")
DTYPE_OPTION_FIELDS = {
    "export_dtype": "str",
    "flags": "strs",
    "flags_if_cpu_lacks": "flag_map",
    "submodule_flags": "flag_map",
    "submodule_export": "obj_map",
    "notes_if_cpu_has": "str_map",
    "tuning_specs": "str_map",
    "if_cpu_lacks": "obj_map",
    "if_cpu_has": "obj_map",
}
CPU_LACK_FIELDS = {
    "preprocessing_specs": "str_map",
    "tuning_specs": "str_map",
    "submodule_export": "obj_map",
    "submodule_flags": "flag_map",
}
# Export choices (compile/exporters: ATTENTIONS, CONV_CHOICES; runtime stays torch-free, so
# they are repeated here and a test keeps them equal).
EXPORT_CHOICES = {
    "attention": ("sdpa", "sdpa_pow2", "sdpa_pow2_keys", "decomposed", "chunked", "fused_f32"),
    "conv": (
        "native",
        "matmul",
        "winograd",
        "winograd4",
        "pointwise_einsum",
        "pointwise_einsum_fhwc",
    ),
    "linear": ("native", "flat", "panels", "amx", "f32"),
    "transformer": ("native", "channels_first"),  # the UNet's transformer blocks
    "winograd_output": ("batched", "interleaved"),  # a split Winograd conv's inverse transform
    "layout": ("native", "channels_last"),  # the VAE decoder's or UNet's activations
    # the kernel of the split Winograd products and `chunked` attention's matmuls: iree's, or
    # sdiree's AMX one (compile/exporters/amx_matmul.py)
    "matmul_kernel": ("iree", "amx", "f32"),
    # the AMX kernels' operands: bf16, or each f32 value as two bf16 parts, three products
    # (fp32-class results; compile/exporters/amx_matmul.py)
    "amx_operands": ("bf16", "bf16x3"),
    # the instruction set of sdiree's kernels: AMX's tiles, or AVX-512 bf16 dot products on a
    # CPU without AMX (compile/exporters/amx_matmul.py KERNEL_ISAS)
    "kernel_isa": ("amx", "avx512_bf16"),
    # under matmul_kernel amx, the UNet's wide 3x3 convs on the direct conv kernel, or none of
    # them: all Winograd (compile/exporters/conv_matmul.py DIRECT_CONVS)
    "direct_convs": ("wide", "none"),
    # under matmul_kernel amx, the UNet's F(2x2) Winograd convs as iree's passes around the
    # matmul kernel, or on sdiree's fused Winograd kernels (compile/exporters/winograd_fused.py)
    "winograd_kernel": ("none", "fused"),
    # each GroupNorm's sums over its whole group, or in chunks of 1024 values and then over
    # the chunks (lavapipe, whose shaders stop looping after 65,535 iterations:
    # compile/exporters/norm_precision.py)
    "norm_sums": ("whole", "chunked"),
}
# positive integers, in submodule_export.unet only: F(4x4) from this input side; plain matmuls
# where the input side is at most the latent's / this
UNET_ONLY_EXPORT = ("winograd4_min_side", "plain_from_downscale")
# choices that only some submodules take other than their default: {choice: (submodules, default)}
ONE_SUBMODULE_EXPORT = {
    "layout": (("vae_decoder", "unet"), "native"),
    "direct_convs": (("unet",), "wide"),
    "winograd_kernel": (("unet",), "none"),
}
# positive integers, any submodule: Winograd convs one matmul per tile element from this side;
# `chunked` attention's score block budget in bytes
SIDE_EXPORT = ("winograd_split_min_side", "attention_block_bytes")
KIND_NAMES = {
    "int": "an integer",
    "str": "a string",
    "bool": "true or false",
    "strs": "a list of strings",
    "dict": "an object",
    "obj_map": "an object of objects",
    "str_map": "an object of strings",
    "flag_map": "an object of string lists",
    "features": '"host" or a list of strings',
}


def _is_strs(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _fits(v, kind: str) -> bool:
    checks = {
        "int": lambda: isinstance(v, int) and not isinstance(v, bool),
        "str": lambda: isinstance(v, str),
        "bool": lambda: isinstance(v, bool),
        "strs": lambda: _is_strs(v),
        "dict": lambda: isinstance(v, dict),
        "obj_map": lambda: isinstance(v, dict) and all(isinstance(x, dict) for x in v.values()),
        "str_map": lambda: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
        "flag_map": lambda: isinstance(v, dict) and all(map(_is_strs, v.values())),
        "features": lambda: v == "host" or _is_strs(v),
    }
    return checks[kind]()


class _Checker:
    """Reports the first problem in targets.json as one line naming the field's place."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str) -> None:
        raise UserError(
            f"{self.path}: {where + ' ' if where else ''}{problem}; fix it (specs/README.md lists the fields) or "
            "restore the shipped specs"
        )

    def fields(self, obj: dict, kinds: dict, required: tuple[str, ...], where: str) -> None:
        for key, value in obj.items():
            if key.startswith("_"):
                continue
            at = f"{where}.{key}" if where else key
            if key not in kinds:
                self.fail(at, f"is not a known field ({', '.join(kinds)})")
            if not _fits(value, kinds[key]):
                self.fail(at, f"must be {KIND_NAMES[kinds[key]]}, not {value!r:.60}")
        for key in required:
            if key not in obj:
                self.fail(where, f"has no '{key}'")

    def export(self, choices: dict, where: str, sub: str | None, nullable: bool = False) -> None:
        """Export choices of submodule sub (None: of every submodule)."""
        unet = sub == "unet"
        for key, value in choices.items():
            sized = key in UNET_ONLY_EXPORT or key in SIDE_EXPORT
            if value is None and nullable and (key in EXPORT_CHOICES or sized):
                continue
            if key in SIDE_EXPORT or (key in UNET_ONLY_EXPORT and unet):
                if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                    self.fail(f"{where}.{key}", f"must be a positive integer, not {value!r:.60}")
            elif key in UNET_ONLY_EXPORT:
                self.fail(f"{where}.{key}", "applies to the unet only (submodule_export.unet)")
            elif key not in EXPORT_CHOICES:
                known = [*EXPORT_CHOICES, *UNET_ONLY_EXPORT, *SIDE_EXPORT]
                self.fail(f"{where}.{key}", f"is not a known export choice ({', '.join(known)})")
            elif value not in EXPORT_CHOICES[key]:
                self.fail(
                    f"{where}.{key}",
                    f"is {value!r:.60}, not one of {', '.join(EXPORT_CHOICES[key])}",
                )
            elif key in ONE_SUBMODULE_EXPORT and value != ONE_SUBMODULE_EXPORT[key][1]:
                only = ONE_SUBMODULE_EXPORT[key][0]
                if sub not in only:
                    self.fail(
                        f"{where}.{key}",
                        f"applies to the {' and the '.join(only)} only (submodule_export)",
                    )

    def names(self, keys, allowed, where: str, what: str) -> None:
        for k in keys:
            if k not in allowed:
                self.fail(where, f"names {what} '{k}', which is not one of {', '.join(allowed)}")


def check_registry(data: dict, path: Path) -> None:
    """Check every field of a parsed targets.json and every name one field gives another."""
    c = _Checker(path)
    c.fields(data, TOP_FIELDS, ("targets",), "")
    if not data["targets"]:
        c.fail("targets", "is empty")
    submodules = submodule_names()
    for name, t in data["targets"].items():
        w = f"targets.{name}"
        c.fields(t, TARGET_FIELDS, ("driver", "default_dtype", "default_arch", "arches"), w)
        dtypes = t.get("dtypes", list(DTYPES))
        c.names(dtypes, DTYPES, f"{w}.dtypes", "dtype")
        if not dtypes:
            c.fail(f"{w}.dtypes", "is empty")
        c.names([t["default_dtype"]], dtypes, f"{w}.default_dtype", "dtype")
        if not t["arches"]:
            c.fail(f"{w}.arches", "is empty")
        c.names([t["default_arch"]], [*t["arches"], "auto"], f"{w}.default_arch", "arch preset")
        c.names(t.get("refused_dtypes", {}), dtypes, f"{w}.refused_dtypes", "dtype")
        c.names(t.get("dtype_options", {}), dtypes, f"{w}.dtype_options", "dtype")
        for key in ("submodule_flags", "submodule_export"):
            c.names(t.get(key, {}), submodules, f"{w}.{key}", "submodule")
        c.export(t.get("export", {}), f"{w}.export", None)
        for sub, choices in t.get("submodule_export", {}).items():
            c.export(choices, f"{w}.submodule_export.{sub}", sub)
        c.names(t.get("tuning_specs", {}), [*submodules, "*"], f"{w}.tuning_specs", "submodule")
        c.names(
            [t.get("tuning_spec_via", "flag")],
            ("flag", "module-attribute"),
            f"{w}.tuning_spec_via",
            "way",
        )
        for d, opt in t.get("dtype_options", {}).items():
            wd = f"{w}.dtype_options.{d}"
            c.fields(opt, DTYPE_OPTION_FIELDS, ("export_dtype",), wd)
            c.names([opt["export_dtype"]], DTYPES, f"{wd}.export_dtype", "dtype")
            c.names(opt.get("submodule_flags", {}), submodules, wd, "submodule")
            c.names(opt.get("submodule_export", {}), submodules, wd, "submodule")
            c.names(
                opt.get("tuning_specs", {}), [*submodules, "*"], f"{wd}.tuning_specs", "submodule"
            )
            for sub, choices in opt.get("submodule_export", {}).items():
                at = f"{wd}.submodule_export.{sub}"
                c.export(choices, at, sub, nullable=True)
            for when in ("if_cpu_lacks", "if_cpu_has"):
                for feature, lack in opt.get(when, {}).items():
                    at = f"{wd}.{when}.{feature}"
                    c.fields(lack, CPU_LACK_FIELDS, (), at)
                    for key in CPU_LACK_FIELDS:
                        c.names(lack.get(key, {}), submodules, f"{at}.{key}", "submodule")
                    for sub, choices in lack.get("submodule_export", {}).items():
                        c.export(choices, f"{at}.submodule_export.{sub}", sub, nullable=True)
        for a, spec in t["arches"].items():
            wa = f"{w}.arches.{a}"
            c.fields(spec, ARCH_FIELDS, (), wa)
            c.names(spec.get("refused_dtypes", {}), dtypes, f"{wa}.refused_dtypes", "dtype")
            c.names(
                spec.get("tuning_specs", {}), [*submodules, "*"], f"{wa}.tuning_specs", "submodule"
            )
            c.names(spec.get("device", {}), DEVICE_FIELDS, f"{wa}.device", "device requirement")
            c.export(spec.get("export", {}), f"{wa}.export", None, nullable=True)
            for pattern in spec.get("device_match", ()):
                try:
                    re.compile(pattern)
                except re.error as e:
                    c.fail(f"{wa}.device_match", f"holds {pattern!r}, not a regex ({e})")
        if all(d in t.get("refused_dtypes", {}) for d in dtypes):
            c.fail(f"{w}.refused_dtypes", "refuses every dtype the target has")
        if "encoder" in t:
            c.fields(t["encoder"], ENCODER_FIELDS, ("driver", "flags"), f"{w}.encoder")
            if not t.get("encode_parameters"):
                c.fail(f"{w}.encoder", "is set but encode_parameters is not true")


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
