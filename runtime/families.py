"""The model-family registry: specs/families.json read into typed records, and detection.

A family (SD 1.x, SD 2.x, ...) is data: how a diffusers folder of it is recognised (its
model_index.json `_class_name`, its components' classes and config keys), the submodules
compiled for it with their entry functions and where their shapes come from, its text-encoder
recipe, the image sizes it takes and the pipeline the runtime drives (or, for folders whose
configs match a `pipeline_variants` entry, such as a 9-channel inpainting UNet, that one). `detect` reads a folder's
index and configs (already parsed: this module touches no model file) and names its family, or
refuses it in one line: a family sdiree does not compile, or parts from different families.
Torch-free: compile uses it to refuse early, run to pick the pipeline of an artifact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from .errors import UserError

SCHEMA_VERSION = 1
DEFAULT_FAMILY = "sd1"  # manifests written before families were recorded are all SD 1.x
STATUSES = ("supported", "refused")
# The pipelines this runtime can drive: "text2img" (runtime/pipeline.py) also runs img2img
# (runtime/img2img.py) and inpainting with the ordinary UNet's latent blending; "inpaint"
# (runtime/inpaint.py) is a dedicated inpainting UNet's (9 input channels).
PIPELINES = ("text2img", "inpaint")
FAMILY_FIELDS = {
    "label": str,
    "description": str,
    "status": str,
    "refusal": str,
    "pipeline_classes": list,
    "classes": dict,
    "recognise": dict,
    "prediction_types": list,
    "size_multiple": int,
    "submodules": dict,
    "shapes": dict,
    "text_encoders": list,
    "pipeline": str,
    "pipeline_variants": dict,
    "unet_conditioning": dict,
    "zero_empty_negative": dict,
    "vae_upcast": dict,
}
SUPPORTED_NEEDS = ("submodules", "text_encoders", "pipeline", "size_multiple", "classes")
TOP_FIELDS = {
    "schema_version": int,
    "config_defaults": dict,
    "shown_keys": dict,
    "families": dict,
    "refused_pipelines": dict,
    "refused_components": dict,
}


@dataclass(frozen=True)
class Family:
    name: str
    label: str  # for people: "SD 1.x"
    description: str
    status: str
    pipeline_classes: tuple[str, ...]
    recognise: dict  # {component: {config key: [accepted values]}}
    refusal: str = ""
    classes: dict | None = None  # {component: [library classes]}
    prediction_types: tuple[str, ...] = ()
    size_multiple: int = 8
    submodules: dict | None = None  # {submodule: {"component": ..., "functions": [...]}}
    shapes: dict | None = None  # {shape: "component.config_key"}
    text_encoders: tuple[dict, ...] = ()
    pipeline: str = ""
    # {pipeline: {component: {config key: [values]}}}: folders matching it run that pipeline
    pipeline_variants: dict | None = None
    # The UNet's inputs besides the text ({"text_embeds": the text-encoder submodule whose
    # pooled output it takes, "time_ids": [what each pair of ids is]}); None: the text only.
    unet_conditioning: dict | None = None
    # {"index_key": model_index.json key, "default": value when absent}: where it is true, an
    # empty negative prompt is zeros rather than the encoded "" (SDXL's force_zeros_for_empty_prompt)
    zero_empty_negative: dict | None = None
    # {"config_key": VAE config key, "default": value when absent}: where it is true and the
    # target computes in fp16, the VAE is compiled in fp32 (SDXL's VAE overflows in fp16)
    vae_upcast: dict | None = None

    @property
    def supported(self) -> bool:
        return self.status == "supported"


@dataclass(frozen=True)
class Families:
    path: Path
    families: dict[str, Family]
    config_defaults: dict
    shown_keys: dict
    refused_pipelines: dict[str, str]
    refused_components: dict[str, str]

    def family(self, name: str) -> Family:
        if name not in self.families:
            raise UserError(
                f"model family '{name}' is not one this sdiree knows "
                f"({', '.join(self.families)}); a newer sdiree may run it"
            )
        return self.families[name]

    def supported_names(self) -> str:
        return ", ".join(f.label for f in self.families.values() if f.supported)

    def pipeline_for(self, fam: Family, configs: dict) -> str:
        """The pipeline that runs a folder of family ``fam`` with these component configs: the
        first of its ``pipeline_variants`` whose rules they all meet, else its ``pipeline``."""
        for pipeline, rules in (fam.pipeline_variants or {}).items():
            if all(
                _value(self, comp, configs.get(comp) or {}, key) in allowed
                for comp, keys in rules.items()
                for key, allowed in keys.items()
            ):
                return pipeline
        return fam.pipeline

    def detect(self, index: dict, configs: dict, where: str) -> Family:
        """The family of a folder from its model_index.json and component configs ({component:
        parsed config, or None where unreadable: such a config decides nothing here and is
        reported by whoever reads it next). UserError in one line when it is refused."""
        return _detect(self, index, configs, where)


def _fail(path: Path, problem: str) -> UserError:
    return UserError(f"{path}: {problem}; restore the shipped specs/families.json")


def _check(data, path: Path) -> None:
    if not isinstance(data, dict):
        raise _fail(path, "is not a JSON object")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise _fail(path, f"schema_version is {data.get('schema_version')!r}, not {SCHEMA_VERSION}")
    for key, kind in TOP_FIELDS.items():
        if key in data and not isinstance(data[key], kind):
            raise _fail(path, f"'{key}' must be a JSON {kind.__name__}")
    if not data.get("families"):
        raise _fail(path, "'families' is missing or empty")
    for name, f in data["families"].items():
        if not isinstance(f, dict):
            raise _fail(path, f"families.{name} is not an object")
        for key, value in f.items():
            if key.startswith("_"):
                continue
            kind = FAMILY_FIELDS.get(key)
            if kind is None:
                raise _fail(path, f"families.{name}.{key} is not a known field")
            if not isinstance(value, kind) or isinstance(value, bool):
                raise _fail(path, f"families.{name}.{key} must be a JSON {kind.__name__}")
        if f.get("status") not in STATUSES:
            raise _fail(path, f"families.{name}.status must be one of {', '.join(STATUSES)}")
        if f["status"] == "supported":
            missing = [k for k in SUPPORTED_NEEDS if k not in f]
            if missing:
                raise _fail(path, f"families.{name} is supported but has no {missing[0]}")
            if f["pipeline"] not in PIPELINES:
                raise _fail(path, f"families.{name}.pipeline names no pipeline ({PIPELINES})")
            for variant in f.get("pipeline_variants", {}):
                if variant not in PIPELINES:
                    raise _fail(
                        path, f"families.{name}.pipeline_variants names no pipeline ({PIPELINES})"
                    )
        elif not f.get("refusal"):
            raise _fail(path, f"families.{name} is refused but gives no 'refusal' line")


def default_path() -> Path:
    return Path(str(resources.files("sdiree.specs"))) / "families.json"


def load_families(path: Path | None = None) -> Families:
    """Read and check families.json (default: the shipped one)."""
    return _load(Path(path) if path else default_path())


@cache
def _load(path: Path) -> Families:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise UserError(f"{path} is missing; reinstall sdiree") from None
    except (ValueError, OSError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _fail(path, f"is not valid JSON ({why})") from None
    _check(data, path)
    families = {
        name: Family(
            name=name,
            label=f.get("label", name),
            description=f.get("description", ""),
            status=f["status"],
            pipeline_classes=tuple(f.get("pipeline_classes", ())),
            recognise=f.get("recognise", {}),
            refusal=f.get("refusal", ""),
            classes=f.get("classes"),
            prediction_types=tuple(f.get("prediction_types", ())),
            size_multiple=f.get("size_multiple", 8),
            submodules=f.get("submodules"),
            shapes=f.get("shapes"),
            text_encoders=tuple(f.get("text_encoders", ())),
            pipeline=f.get("pipeline", ""),
            pipeline_variants=f.get("pipeline_variants"),
            unet_conditioning=f.get("unet_conditioning"),
            zero_empty_negative=f.get("zero_empty_negative"),
            vae_upcast=f.get("vae_upcast"),
        )
        for name, f in data["families"].items()
    }
    return Families(
        path=path,
        families=families,
        config_defaults=data.get("config_defaults", {}),
        shown_keys=data.get("shown_keys", {}),
        refused_pipelines=data.get("refused_pipelines", {}),
        refused_components=data.get("refused_components", {}),
    )


def _is_pair(entry) -> bool:
    return isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)


def _value(reg: Families, component: str, config: dict, key: str):
    return config.get(key, reg.config_defaults.get(component, {}).get(key))


def _matches(reg: Families, fam: Family, component: str, config: dict) -> bool:
    rules = fam.recognise.get(component, {})
    return all(_value(reg, component, config, k) in allowed for k, allowed in rules.items())


def _shown(reg: Families, component: str, config: dict) -> str:
    keys = reg.shown_keys.get(component, ())
    return ", ".join(f"{k} {json.dumps(_value(reg, component, config, k))}" for k in keys)


def _names(fams) -> str:
    return " or ".join(f.label for f in fams) if fams else "no known family"


def _detect(reg: Families, index: dict, configs: dict, where: str) -> Family:
    cls = index.get("_class_name")
    cls = cls if isinstance(cls, str) else None
    supported = reg.supported_names()
    if cls in reg.refused_pipelines:
        raise UserError(
            f"{where}: model_index.json names {cls}, {reg.refused_pipelines[cls]}; sdiree "
            f"compiles these model families only: {supported}"
        )
    for comp, what in reg.refused_components.items():
        if _is_pair(index.get(comp)):
            raise UserError(
                f"{where}: model_index.json lists a '{comp}' component ({what}); sdiree "
                f"compiles these model families only: {supported}"
            )
    fams = list(reg.families.values())
    by_class = [f for f in fams if cls in f.pipeline_classes]
    if by_class and not any(f.supported for f in by_class):
        raise UserError(f"{where}: model_index.json names {cls}: {by_class[0].refusal}")
    found = {c: cfg for c, cfg in configs.items() if isinstance(cfg, dict)}
    per_part = {c: [f for f in fams if _matches(reg, f, c, cfg)] for c, cfg in found.items()}
    candidates = [f for f in (by_class or fams) if all(f in m for m in per_part.values())]
    if not candidates:
        raise UserError(_mixed_message(reg, index, cls, by_class, per_part, found, where))
    fam = candidates[0]
    if not fam.supported:
        parts = "; ".join(f"{c}/config.json has {_shown(reg, c, found[c])}" for c in found)
        raise UserError(f"{where}: {fam.refusal} ({parts})")
    _check_text_dim(fam, found, where)
    return fam


def _mixed_message(reg, index, cls, by_class, per_part, found, where) -> str:
    encoders = sum(1 for k, v in index.items() if k.startswith("text_encoder") and _is_pair(v))
    unknown = [c for c, m in per_part.items() if not m]
    if unknown and not by_class:
        c = unknown[0]
        return (
            f"{where}: {c}/config.json ({_shown(reg, c, found[c])}) is of no model family "
            f"sdiree knows; it compiles: {reg.supported_names()}"
        )
    parts = [f"model_index.json names {cls} ({_names(by_class)})"] if by_class else []
    parts += [
        f"{c}/config.json looks like {_names(m)} ({_shown(reg, c, found[c])})"
        for c, m in per_part.items()
    ]
    parts.append(f"{encoders} text encoder{'s' if encoders != 1 else ''}")
    return (
        f"{where} mixes model families: {'; '.join(parts)}; re-download or re-save the model "
        "as one pipeline"
    )


def _check_text_dim(fam: Family, found: dict, where: str) -> None:
    """The UNet's cross-attention width is the text encoders' hidden sizes together."""
    unet = found.get("unet", {})
    sizes = [found.get(te["submodule"], {}).get("hidden_size") for te in fam.text_encoders]
    dim = unet.get("cross_attention_dim")
    if not all(isinstance(s, int) for s in sizes) or not isinstance(dim, int):
        return  # absent or mistyped: the config checks report it
    if dim != sum(sizes):
        raise UserError(
            f"{where}: unet/config.json's cross_attention_dim {dim} does not match the text "
            f"{'encoders' if len(sizes) > 1 else 'encoder'}'{'' if len(sizes) > 1 else 's'} "
            f"hidden_size {' + '.join(map(str, sizes))}: "
            "the UNet and text encoder come from different models; re-download or re-save the "
            "model"
        )
