"""What `sdiree compile` will do, decided before any file is written: options, checks, choices.

`resolve` reads the registry and the model folder (its family detected or refused), picks the
arch, dtype and size, checks every input, and decides where files go: the artifact directory
(`--out`), the per-model compile cache (`artifacts/<model>/` for the default --out,
`$SDIREE_CACHE/<model>/` for an explicit one) and the build cache every compile shares, whatever
its --out (the user cache, `$SDIREE_CACHE`; see compile/driver.py). It raises UserError and
writes nothing; compile/driver.py then builds the Plan.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from sdiree.runtime.errors import UserError
from sdiree.runtime.fileutil import sha256_file, user_cache_dir
from sdiree.runtime.targets import Registry, Target, load_registry
from sdiree.runtime.vae_tiling import check_tile, tile_shapes

from . import arch_select
from .model_source import ModelSource, open_model
from .report import Reporter

SUBMODULES = ("text_encoder", "unet", "vae_decoder", "vae_encoder")
# The largest --height/--width: 8x SD 1.5's 512. The UNet's first self-attention runs over
# (side/8)^2 tokens, so its cost grows with the fourth power of the side; past this, one call
# is out of reach of a single machine's memory and time.
MAX_SIDE = 4096
CACHE_ENV = "SDIREE_CACHE"


@dataclass
class CompileOptions:
    model_dir: Path
    target: str
    arch: str | None = None
    dtype: str | None = None
    height: int | None = None
    width: int | None = None
    batch_size: int = 1
    out: Path | None = None
    specs_dir: Path | None = None
    artifacts_root: Path = Path("artifacts")
    # None: every submodule of the model's family (specs/families.json)
    submodules: tuple[str, ...] | None = None
    # Side in px of the VAE's tiles (`--vae-tile`): None, the VAE config's sample_size (as
    # diffusers' enable_tiling); 0, never tile.
    vae_tile: int | None = None
    # A single-file checkpoint's configs (`--config`: a diffusers folder of its architecture;
    # None: the shipped preset of its family) and prediction type (`--prediction-type`).
    config_dir: Path | None = None
    prediction_type: str | None = None
    # Another VAE's weights compiled in (`--vae FILE`: original or diffusers layout).
    vae: Path | None = None
    # More image sizes (px, (height, width)) the artifact runs at besides --height/--width
    # (`--sizes WxH,...`): their own entry functions, sharing the parameters.
    sizes: tuple[tuple[int, int], ...] = ()


@dataclass
class Plan:
    """Everything resolved before any file is written."""

    model: ModelSource
    registry: Registry
    target: Target
    arch: str
    dtype: str
    height: int
    width: int
    batch_size: int
    out: Path
    shared: Path
    submodules: tuple[str, ...]
    configs: dict = field(default_factory=dict)
    explicit_out: bool = True  # --out given: the cache is the user's, not out's parent
    # where the build cache lives (compile/build_cache.py): the user cache, for every --out
    build_root: Path = field(default_factory=user_cache_dir)
    vae_tile: int = 0  # px; 0: the VAE modules take the whole image
    vae_file: Path | None = None  # --vae: its weights replace the model's VAE's
    extra_sizes: tuple[tuple[int, int], ...] = ()  # --sizes besides (height, width), px

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """Every image size (px, (height, width)) the artifact runs at, the main one first."""
        return [(self.height, self.width), *self.extra_sizes]

    @property
    def latent_hws(self) -> list[tuple[int, int]]:
        f = self.vae_factor
        return [(h // f, w // f) for h, w in self.sizes]

    def _tiled(self, hw: tuple[int, int]) -> bool:
        return bool(self.vae_tile) and max(hw) > self.vae_tile

    @property
    def vae_tiled(self) -> bool:
        """An image is larger than a VAE tile: the VAE modules are compiled for tiles."""
        return any(self._tiled(hw) for hw in self.sizes)

    def vae_image_shapes(self) -> list[tuple[int, int]]:
        """The image sizes (px) the VAE modules take, the main one first: per size the whole
        image, or under tiling every tile shape diffusers' tiling of it makes (edge tiles are
        shorter, and are decoded at their own size, so the tiled result is diffusers')."""
        f = self.vae_factor
        shapes: list[tuple[int, int]] = []
        for hw in self.sizes:
            if not self._tiled(hw):
                shapes.append(hw)
                continue
            latent = (hw[0] // f, hw[1] // f)
            shapes += [(h * f, w * f) for h, w in tile_shapes(latent, self.vae_tile // f)]
        return list(dict.fromkeys(shapes))

    @property
    def family(self):
        """The model's family (sdiree.runtime.families.Family)."""
        return self.model.family

    @property
    def export_dtype(self) -> str:
        """The dtype the model is exported and its parameters saved in (shared across dtypes
        that only compile differently, such as cpu bf16 over fp32)."""
        return self.target.export_dtype(self.dtype)

    @property
    def vae_upcast(self) -> bool:
        """The VAE is exported in fp32 though the build is fp16: the family says its VAE
        overflows in fp16 (`vae_upcast`) and the VAE's config does not say otherwise."""
        policy = self.family.vae_upcast
        if not policy or self.export_dtype != "fp16":
            return False
        return bool(self.configs["vae"].get(policy["config_key"], policy["default"]))

    def submodule_export_dtype(self, submodule: str) -> str:
        """The dtype one submodule is exported in: the build's, or fp32 for an upcast VAE."""
        component = self.family.submodules[submodule]["component"]
        return "fp32" if component == "vae" and self.vae_upcast else self.export_dtype

    @property
    def latent_hw(self) -> tuple[int, int]:
        f = self.vae_factor
        return self.height // f, self.width // f

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.configs["vae"]["block_out_channels"]) - 1)


def resolve(opts: CompileOptions, reporter: Reporter) -> Plan:
    """Check every input and fix every choice; raises UserError, writes nothing."""
    registry = load_registry(opts.specs_dir)
    target = registry.target(opts.target)
    model = open_model(  # its family detected, or refused, here
        opts.model_dir,
        cache_dir=model_cache(opts, Path(opts.model_dir).stem) / "single-file",
        config_dir=opts.config_dir,
        prediction_type=opts.prediction_type,
        say=reporter.say,
        check_classes=False,  # last: it imports diffusers
    )
    family = model.family
    components = ["unet", "vae", *(te["submodule"] for te in family.text_encoders), "scheduler"]
    configs = {c: model.config(c) for c in dict.fromkeys(components)}
    prediction = configs["scheduler"].get("prediction_type", "epsilon")
    if prediction not in family.prediction_types:
        raise UserError(
            f"{model.path}/scheduler/scheduler_config.json: prediction_type {prediction!r} is "
            f"not one an {family.label} model uses ({', '.join(family.prediction_types)})"
        )

    _check_added_conditioning(family, configs, model.path)

    arch = opts.arch or target.default_arch
    if arch == "auto":
        arch, why = arch_select.auto_arch(target)
        reporter.say(f"arch auto: picked {arch} ({why})")
    else:
        target.arch(arch)

    dtype = target.pick_dtype(arch, opts.dtype)
    if opts.dtype is None and dtype != target.default_dtype:
        why = target.refusals(arch)[target.default_dtype]
        reporter.say(f"dtype: {dtype}, as {target.default_dtype} is refused for {arch} ({why})")
    if (opts.arch or target.default_arch) == "auto" and dtype == "fp16":
        lacking = arch_select.device_without_fp16(target)
        if lacking and opts.dtype is None and "fp32" in target.usable_dtypes(arch):
            dtype = "fp32"
            reporter.say(f"dtype: fp32, as '{lacking}' has no fp16 arithmetic (shaderFloat16)")
        elif lacking:
            reporter.say(
                f"note: '{lacking}' has no fp16 arithmetic: this fp16 build will not run there"
            )
    missing = target.missing_cpu_features(dtype, arch)
    if missing:
        reporter.say(
            f"note: {arch}'s CPU has no {', '.join(missing)}, so {dtype} is compiled without the "
            "code paths that need it and runs slower than on a CPU with it (specs/README.md)"
        )
    for note in target.cpu_notes(dtype, arch):
        reporter.say(f"note: {note}")

    vae_factor = 2 ** (len(configs["vae"]["block_out_channels"]) - 1)
    default_hw = configs["unet"]["sample_size"] * vae_factor
    height = default_hw if opts.height is None else opts.height
    width = default_hw if opts.width is None else opts.width
    step = family.size_multiple
    for label, v in (("height", height), ("width", width)):
        _check_side(f"--{label} {v}", v, step, family.label, default_hw, model.name)
    for h, w in opts.sizes:
        for v in (h, w):
            what = f"--sizes {w}x{h}: its side {v}"
            _check_side(what, v, step, family.label, default_hw, model.name)
    extra_sizes = tuple(dict.fromkeys(hw for hw in opts.sizes if hw != (height, width)))
    if opts.batch_size < 1:
        raise UserError(f"--batch-size {opts.batch_size} must be at least 1")
    vae_tile = _vae_tile(opts.vae_tile, configs["vae"], vae_factor, reporter)

    if opts.out is None:
        shared = model_cache(opts, model.name)
        more = "".join(f"+{h}x{w}" for h, w in extra_sizes)
        out = shared / f"{target.name}-{arch}-{dtype}-{height}x{width}{more}-b{opts.batch_size}"
    else:
        out = Path(opts.out).absolute()
        shared = user_cache_dir() / model.name
    _check_not_in_model(out, model.path)
    _check_writable(out)
    _check_writable(shared, f"the compile cache {shared}", f"set {CACHE_ENV} to a writable folder")
    known = tuple(family.submodules)
    submodules = known if opts.submodules is None else tuple(opts.submodules)
    unknown = set(submodules) - set(known)
    if unknown:
        raise UserError(f"unknown submodule(s) {sorted(unknown)}: choose from {known}")
    plan = Plan(
        model=model,
        registry=registry,
        target=target,
        arch=arch,
        dtype=dtype,
        height=height,
        width=width,
        batch_size=opts.batch_size,
        out=out,
        shared=shared,
        submodules=submodules,
        configs=configs,
        explicit_out=opts.out is not None,
        vae_tile=vae_tile,
        vae_file=_vae_file(opts.vae),
        extra_sizes=extra_sizes,
    )
    model.check_classes()
    _say_vae_precision(plan, reporter)
    return plan


def _check_added_conditioning(family, configs: dict, where: Path) -> None:
    """The UNet's added embedding takes what the family's recipe gives it: the pooled text's
    width plus a sinusoidal embedding per time id (SDXL: 1280 + 6 x 256 = 2816)."""
    spec = family.unet_conditioning
    if not spec:
        return
    unet = configs["unet"]
    pooled = configs[spec["text_embeds"]].get("projection_dim")
    per_id = unet.get("addition_time_embed_dim")
    want = unet.get("projection_class_embeddings_input_dim")
    ids = 2 * len(spec["time_ids"])
    if not all(isinstance(v, int) for v in (pooled, per_id, want)) or pooled + ids * per_id != want:
        raise UserError(
            f"{where}: unet/config.json's projection_class_embeddings_input_dim {want} is not "
            f"{spec['text_embeds']}'s projection_dim {pooled} + {ids} time ids x "
            f"addition_time_embed_dim {per_id}: the UNet and text encoders come from different "
            "models; re-download or re-save the model"
        )


def _say_vae_precision(plan: Plan, reporter: Reporter) -> None:
    """Where the family's VAE may overflow in fp16 and the build is fp16, which dtype the VAE
    gets and why (the manifest records it too: `vae_precision`)."""
    policy = plan.family.vae_upcast
    if not policy or plan.export_dtype != "fp16":
        return
    key = policy["config_key"]
    if plan.vae_upcast:
        reporter.say(
            f"VAE: compiled in fp32, not fp16 (vae/config.json {key}: "
            f"{json.dumps(plan.configs['vae'].get(key, policy['default']))}; "
            f"{plan.family.label}'s VAE overflows in fp16)"
        )
    else:
        reporter.say(f"VAE: compiled in fp16 (vae/config.json {key}: false, an fp16-safe VAE)")


def _check_side(what: str, v: int, step: int, label: str, default_hw: int, model: str) -> None:
    if v <= 0 or v % step:
        raise UserError(
            f"{what} is not a positive multiple of {step}, which {label} models need; "
            f"use e.g. {default_hw}"
        )
    if v > MAX_SIDE:
        raise UserError(
            f"{what} is larger than sdiree compiles ({MAX_SIDE} at most); {model} was "
            f"trained at {default_hw}"
        )


def _vae_file(path: Path | None) -> Path | None:
    """--vae, checked to hold VAE weights before anything is written (shapes are checked
    against the model's VAE when it is loaded)."""
    if path is None:
        return None
    from sdiree.runtime.weights.sources import read_vae_file

    if not Path(path).is_file():
        raise UserError(f"--vae {path} does not exist")
    read_vae_file(Path(path))
    return Path(path)


def _vae_tile(asked: int | None, vae_cfg: dict, vae_factor: int, reporter: Reporter) -> int:
    """The VAE tile side in px: --vae-tile, else the VAE's sample_size, which is diffusers'
    tile; 0 where none applies."""
    if asked is not None:
        if asked:
            check_tile(asked, vae_factor)
        return asked
    side = vae_cfg.get("sample_size") or 0
    side = side[0] if isinstance(side, list | tuple) else int(side)
    if side < 4 * vae_factor or side % (4 * vae_factor):
        reporter.say(f"note: the VAE's sample_size {side} is no tile size: it decodes whole")
        return 0
    return side


def model_cache(opts: CompileOptions, name: str) -> Path:
    """The compile cache of the model named name: `artifacts/<name>/` for the default --out,
    `$SDIREE_CACHE/<name>/` for an explicit one (a single file's converted folder goes there
    too, before the model is opened)."""
    if opts.out is None:
        return Path(opts.artifacts_root).absolute() / name
    return user_cache_dir() / name


def _check_not_in_model(out: Path, model_dir: Path) -> None:
    model_dir, real_out = Path(model_dir).resolve(), out.resolve()
    if real_out == model_dir or model_dir in real_out.parents:
        raise UserError(
            f"--out {out} is inside the model folder {model_dir}; choose a folder outside it"
        )


def _check_writable(out: Path, what: str = "", fix: str = "choose another --out") -> None:
    """Fail early, without creating anything, when out cannot be created or written."""
    what = what or f"--out {out}"
    probe = out
    while not probe.exists() and not probe.is_symlink():
        probe = probe.parent
    if out.exists() and not out.is_dir():
        raise UserError(f"{what} exists and is not a directory; {fix}")
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"cannot write to {out} ({probe} is not a writable folder); {fix}")


def tuning_spec(plan: Plan, submodule: str) -> tuple[str, Path] | None:
    """(registry-relative path, file) of the tuning spec a submodule compiles with, if any: the
    dtype's for a feature the arch's CPU lacks, else the arch preset's, else the dtype's, else
    the target's (a submodule's own entry before "*")."""
    t = plan.target
    arch = t.arch(plan.arch)
    opt = t.dtype_options.get(plan.dtype)
    maps = (arch.tuning_specs, opt.tuning_specs if opt else {}, t.tuning_specs)
    rel = t.cpu_tuning_spec(plan.dtype, plan.arch, submodule) or next(
        (m[k] for m in maps for k in (submodule, "*") if k in m), None
    )
    return _spec_file(plan, rel, "tuning spec")


def _spec_file(plan: Plan, rel: str | None, what: str) -> tuple[str, Path] | None:
    """(rel, its file in the specs directory), which must exist; None for no spec."""
    if rel is None:
        return None
    spec = plan.registry.spec_path(rel)
    if not spec.is_file():
        raise UserError(f"{what} {spec} named in targets.json does not exist")
    return rel, spec


def preprocessing_spec(plan: Plan, submodule: str) -> tuple[str, Path] | None:
    """(registry-relative path, file) of the preprocessing transform spec a submodule compiles
    with (`--iree-preprocessing-transform-spec-filename`), if its dtype option names one for
    a feature the arch's CPU lacks."""
    rel = plan.target.preprocessing_spec(plan.dtype, plan.arch, submodule)
    return _spec_file(plan, rel, "preprocessing spec")


def embedded_spec(plan: Plan, submodule: str) -> Path | None:
    """The spec to attach to the module itself (compile/tuning_embed.py), where the target takes
    its specs that way."""
    found = tuning_spec(plan, submodule)
    return found[1] if found and plan.target.tuning_spec_via == "module-attribute" else None


def flags_for(plan: Plan, submodule: str) -> tuple[list[str], dict[str, str]]:
    """The full iree-compile flag list for a submodule, and {spec path: sha256} it uses."""
    t = plan.target
    flags = t.compile_flags(plan.arch, plan.dtype, submodule)
    specs = {}
    found = tuning_spec(plan, submodule)
    if found:
        rel, spec = found
        specs[rel] = sha256_file(spec)
        if t.tuning_spec_via == "flag":
            flags.append(f"--iree-codegen-tuning-spec-path={spec}")
    pre = preprocessing_spec(plan, submodule)
    if pre:
        rel, spec = pre
        specs[rel] = sha256_file(spec)
        flags.append(f"--iree-preprocessing-transform-spec-filename={spec}")
    return flags, specs
