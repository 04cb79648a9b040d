"""Plan the merge of one or more LoRA files into a model's weights, then merge weight by weight.

`plan_loras` matches every layer of every LoRA file to the model's parameter keys, checks the
shapes and the strengths, and decides each layer's scale. It refuses (UserError, one line) a
strength that is not finite, a file with no LoRA layer, a DoRA file, a LoRA whose layers
match none of the model's weights, and one with a layer whose shape differs from the weight it
names (a LoRA for another model family). What it cannot apply but is no reason to refuse is
reported, never dropped silently: `LoraPlan.warnings()` lists per file how many layers match
no weight, use a kind sdiree has no formula for, lack a factor or repeat another layer, and
how many keys fit no known layout, naming the first few; the caller prints them.

What is applied: every layer whose component the model has, the UNet's and the text
encoders' alike, each with its strength (A1111's separate text-encoder strength optional);
layers of a component the model lacks (``lora_te2_`` on SD 1.x) are reported as unmatched. A
layer a file holds under two names (diffusers' and the original UNet's) is applied once, under
its diffusers name, the other reported. The only keys consumed without a change of their own are the alpha/scale values of applied
layers. A layer's scale: its ``scale`` key if present (LyCORIS), else ``alpha / rank`` from
its ``alpha`` key (kohya, LyCORIS; a LoKr with neither factor decomposed has no rank: scale
1), else for diffusers/PEFT files ``lora_alpha / rank`` (``/ sqrt(rank)`` with rsLoRA) from the
``lora_adapter_metadata`` diffusers writes into the file (``alpha_pattern`` per layer), else 1.

`LoraPlan.merged(component, key, base)` returns one merged weight: base + sum over files of
strength * scale * delta, computed in float32 and cast back to the base's dtype (fp16,
bf16, fp32), so a caller streaming keys holds one weight and its merge at a time besides
the LoRA files' own tensors.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from . import deltas
from .keys import FileLayer, group_layers
from .targets import TEXT_MODEL, TargetIndex

PEFT_METADATA = "lora_adapter_metadata"  # diffusers' LoraConfig per component, as JSON
SHOWN = 5  # names listed per warning


@dataclass
class LoraSpec:
    """One LoRA file to apply: its tensors and metadata as read, and its strengths."""

    name: str
    tensors: Mapping[str, np.ndarray]
    metadata: Mapping[str, str] | None = None
    strength: float = 1.0
    te_strength: float | None = None  # text encoders' strength; None: `strength`

    def strength_for(self, component: str) -> float:
        if component.startswith("text_encoder") and self.te_strength is not None:
            return float(self.te_strength)
        return float(self.strength)


@dataclass
class LoraReport:
    """What one file changed, and what of it could not be applied."""

    name: str
    applied: dict[str, int] = field(default_factory=dict)  # component -> weights changed
    layers: int = 0
    unmatched: list[str] = field(default_factory=list)
    unsupported: dict[str, list[str]] = field(default_factory=dict)  # kind -> layers
    incomplete: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    unknown_keys: list[str] = field(default_factory=list)

    def warnings(self) -> list[str]:
        out = []
        if self.unmatched:
            out.append(
                f"LoRA {self.name}: {len(self.unmatched)} of its {self.layers} layers match no "
                f"weight of this model and are not applied: {_some(self.unmatched)}"
            )
        for kind, labels in self.unsupported.items():
            what = "mix several kinds" if kind == "mixed" else f"are {kind} layers"
            out.append(
                f"LoRA {self.name}: {len(labels)} layers {what}, which sdiree cannot apply: "
                f"{_some(labels)}"
            )
        if self.incomplete:
            out.append(
                f"LoRA {self.name}: {len(self.incomplete)} layers lack a factor and are not "
                f"applied: {_some(self.incomplete)}"
            )
        if self.duplicates:
            out.append(
                f"LoRA {self.name}: {len(self.duplicates)} layers repeat a layer already applied "
                f"under another name and are skipped: {_some(self.duplicates)}"
            )
        if self.unknown_keys:
            out.append(
                f"LoRA {self.name}: {len(self.unknown_keys)} keys fit no known LoRA layout and "
                f"are ignored: {_some(self.unknown_keys)}"
            )
        return out


@dataclass
class _Change:
    kind: str  # a deltas kind, or "bias": tensors["bias"] itself
    tensors: dict[str, np.ndarray]
    factor: float  # strength * scale


class LoraPlan:
    """The weights a set of LoRA files changes and how; build it with `plan_loras`."""

    def __init__(self, shapes: dict[str, dict[str, tuple[int, ...]]], reports: list[LoraReport]):
        self._shapes = shapes
        self._changes: dict[str, dict[str, list[_Change]]] = {}
        self.reports = reports

    def _add(self, component: str, key: str, change: _Change) -> None:
        self._changes.setdefault(component, {}).setdefault(key, []).append(change)

    @property
    def components(self) -> list[str]:
        return sorted(self._changes)

    def keys(self, component: str) -> list[str]:
        """The keys of `component` the plan changes, sorted."""
        return sorted(self._changes.get(component, {}))

    def warnings(self) -> list[str]:
        return [w for r in self.reports for w in r.warnings()]

    def delta(self, component: str, key: str) -> np.ndarray | None:
        """The summed change of one weight (float32, the weight's shape); None if unchanged."""
        changes = self._changes.get(component, {}).get(key)
        if not changes:
            return None
        target = self._shapes[component][key]
        total = None
        for change in changes:
            if change.kind == "bias":
                d = np.array(change.tensors["bias"], dtype=np.float32)
            else:
                d = deltas.delta(change.kind, change.tensors)
            d = d.reshape(target)
            d *= np.float32(change.factor)  # d is a fresh array: scaled in place
            if total is None:
                total = d
            else:
                total += d
        return total

    def merged(self, component: str, key: str, base: np.ndarray) -> np.ndarray:
        """`base` (the model's tensor for key) with the LoRAs merged in, in base's dtype."""
        base = np.asarray(base)
        target = self._shapes[component][key]
        if base.shape != target:
            raise ValueError(f"{component} {key}: base is {base.shape}, planned for {target}")
        d = self.delta(component, key)
        if d is None:
            return base
        work = np.float64 if base.dtype == np.float64 else np.float32
        out = base.astype(work)
        out += d
        return out if out.dtype == base.dtype else out.astype(base.dtype)


def plan_loras(
    loras: Sequence[LoraSpec | tuple],
    targets: Mapping[str, Mapping[str, Sequence[int]]],
) -> LoraPlan:
    """Plan LoRA files against a model: `loras` are LoraSpecs or (name, tensors, metadata,
    strength) tuples; `targets` the model's parameter shapes, {component: {key: shape}}."""
    index = TargetIndex(targets)
    specs = [s if isinstance(s, LoraSpec) else LoraSpec(*s) for s in loras]
    plan = LoraPlan(index.shapes, [])
    for spec in specs:
        plan.reports.append(_plan_one(plan, index, spec))
    return plan


def _plan_one(plan: LoraPlan, index: TargetIndex, spec: LoraSpec) -> LoraReport:
    name = spec.name
    for s in (spec.strength, spec.te_strength):
        if s is not None and not math.isfinite(float(s)):
            raise UserError(f"LoRA {name}: strength {s} is not a finite number")
    layers, unknown = group_layers(spec.tensors)
    report = LoraReport(name, layers=len(layers), unknown_keys=unknown)
    _refuse_unusable(name, spec.tensors, layers)
    peft = _peft_configs(name, spec.metadata)

    resolved = []  # (how, file order, layer, path)
    for order, layer in enumerate(layers):
        if layer.kind not in deltas.KINDS:
            report.unsupported.setdefault(layer.kind, []).append(layer.label)
            continue
        missing = layer.missing_roles()
        if missing:
            report.incomplete.append(f"{layer.label} (no {', '.join(missing)})")
            continue
        found = index.resolve(layer)
        if found is None:
            report.unmatched.append(layer.label)
            continue
        resolved.append((found[1], order, layer, found[0]))
    if not resolved and report.unmatched:
        raise UserError(
            f"LoRA {name} matches none of this model's weights (its {len(report.unmatched)} "
            f"layers, e.g. {report.unmatched[0]}): is it a LoRA for another model family?"
        )
    if not resolved and report.incomplete:
        raise UserError(
            f"LoRA {name}: none of its layers is complete (e.g. {report.incomplete[0]}); the "
            "file is damaged"
        )

    applied: set[str] = set()
    for _, _, layer, path in sorted(resolved, key=lambda r: (r[0], r[1])):
        component = layer.component
        if path in applied:
            report.duplicates.append(layer.label)
            continue
        applied.add(path)
        factor = spec.strength_for(component) * _scale(name, layer, peft)
        for key, change in _changes_of(name, layer, path, index.shapes[component], report):
            report.applied[component] = report.applied.get(component, 0) + 1
            if factor != 0.0:
                change.factor = factor
                plan._add(component, key, change)
    return report


def _refuse_unusable(name: str, tensors: Mapping, layers: list[FileLayer]) -> None:
    for layer in layers:
        if layer.kind == "dora" or {"dora_scale", "magnitude"} & set(layer.tensors):
            raise UserError(
                f"LoRA {name} is a DoRA (weight-decomposed) LoRA ({layer.label}), which sdiree "
                "cannot apply"
            )
    if not layers:
        first = next(iter(tensors), None)
        example = f", e.g. {first!r}," if first is not None else ""
        raise UserError(
            f"{name} holds no LoRA weights (none of its {len(tensors)} keys{example} is a LoRA "
            "factor): is it a LoRA file?"
        )
    kinds = {layer.kind for layer in layers}
    if not kinds & set(deltas.KINDS):
        raise UserError(
            f"LoRA {name} has only {', '.join(sorted(kinds))} layers, which sdiree cannot apply "
            "(it applies LoRA/LoCon, LoHa, LoKr and full diffs)"
        )


def _changes_of(
    name: str, layer: FileLayer, path: str, shapes: dict[str, tuple[int, ...]], report: LoraReport
) -> list[tuple[str, _Change]]:
    """(key, change) for the weight (and bias) the layer changes, shapes checked."""
    t = layer.tensors
    out = []
    has_weight = layer.kind != "full" or "diff" in t
    if has_weight:
        key = f"{path}.weight"
        try:
            natural = deltas.shape(layer.kind, t)
        except ValueError as e:
            raise UserError(f"LoRA {name}: layer {layer.label}: {e}; the file is damaged") from e
        _check_shape(name, layer, natural, layer.component, key, shapes[key])
        out.append((key, _Change(layer.kind, t, 1.0)))
    bias = t.get("up_bias", t.get("diff_b"))
    if bias is not None:
        key = f"{path}.bias"
        if key not in shapes:
            report.unmatched.append(f"{layer.label} (bias)")
        else:
            _check_shape(name, layer, tuple(bias.shape), layer.component, key, shapes[key])
            out.append((key, _Change("bias", {"bias": bias}, 1.0)))
    return out


def _check_shape(name, layer, natural, component, key, target) -> None:
    fits = natural == target or (
        math.prod(natural) == math.prod(target)
        and natural[0] == target[0]
        and not (len(natural) == 4 and len(target) == 4)
    )
    if not fits:
        raise UserError(
            f"LoRA {name} does not fit this model: its layer {layer.label} changes a "
            f"{_dims(natural)} weight, this model's {component} {key} is {_dims(target)}; is "
            "it a LoRA for another model family?"
        )


def _scale(name: str, layer: FileLayer, peft: dict[str, dict]) -> float:
    t = layer.tensors
    if "scale" in t:
        return _number(name, layer, t["scale"])
    rank = deltas.rank(layer.kind, t)
    if rank is None:
        return 1.0
    if "alpha" in t:
        return _number(name, layer, t["alpha"]) / rank
    config = peft.get(layer.component or "")
    if config is None or layer.flat or layer.kind != "lora":
        return 1.0
    alpha = _pattern_value(config.get("alpha_pattern") or {}, layer.name)
    if alpha is None:
        alpha = config.get("lora_alpha", rank)
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    return float(alpha) / root


def _number(name: str, layer: FileLayer, value) -> float:
    a = np.asarray(value, dtype=np.float64).reshape(-1)
    if a.size != 1 or not math.isfinite(a[0]):
        raise UserError(
            f"LoRA {name}: layer {layer.label} has alpha/scale {a!r}; the file is damaged"
        )
    return float(a[0])


def _pattern_value(patterns: Mapping[str, float], layer_name: str) -> float | None:
    """peft's alpha_pattern lookup: the first pattern matching the end of the layer's path."""
    names = [layer_name]
    if layer_name.startswith(TEXT_MODEL):
        names.append(layer_name[len(TEXT_MODEL) :])
    for pattern, value in patterns.items():
        for n in names:
            try:
                hit = re.match(rf"(.*\.)?({pattern})$", n)
            except re.error:
                hit = n == pattern or n.endswith("." + pattern)
            if hit:
                return float(value)
    return None


def _peft_configs(name: str, metadata: Mapping[str, str] | None) -> dict[str, dict]:
    """diffusers' lora_adapter_metadata -> {component: {"lora_alpha": ..., ...}}."""
    raw = (metadata or {}).get(PEFT_METADATA)
    if not raw:
        return {}
    try:
        flat = json.loads(raw)
    except ValueError as e:
        raise UserError(f"LoRA {name}: its {PEFT_METADATA} metadata is not valid JSON") from e
    if not isinstance(flat, dict):
        raise UserError(f"LoRA {name}: its {PEFT_METADATA} metadata is not a JSON object")
    out: dict[str, dict] = {}
    for key, value in flat.items():
        component, _, option = key.rpartition(".")
        if component:
            out.setdefault(component, {})[option] = value
    return out


def _some(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))
