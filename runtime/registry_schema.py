"""The schema of specs/targets.json: every field a registry may hold, its JSON type, and the
values an export choice takes; check_registry says in one line what is wrong and where.
runtime/targets.py reads a checked registry into typed records."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import UserError

DTYPES = ("fp32", "fp16", "bf16")


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
