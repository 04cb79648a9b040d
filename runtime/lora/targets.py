"""Find the model weight a LoRA layer changes, by names built from the model's own keys.

The index is made from the artifact's parameter keys per component ({"unet": {key: shape},
"text_encoder": {...}}), never from a list of one family's layers. Every layer path (a key
without ``.weight``) is known by:
- its dotted path, with and without transformers' ``text_model.`` prefix (CLIP text encoders
  are keyed either way depending on how they were saved; LoRA files always include it);
- the original LDM/SGM name of a UNet layer (ldm_names.py);
- kohya's flat spelling of each of these: dots replaced by underscores.
A flat name two layers would share is dropped (never guessed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .keys import FileLayer
from .ldm_names import ldm_unet_names

TEXT_MODEL = "text_model."
_AMBIGUOUS = ""

# How a layer was found: direct names rank before original-layout aliases, so that a file
# carrying both spellings of one layer applies it once, under its diffusers name.
DIRECT, LDM = 0, 1


class TargetIndex:
    def __init__(self, targets: Mapping[str, Mapping[str, Sequence[int]]]):
        self.shapes = {
            c: {k: tuple(int(d) for d in s) for k, s in keys.items()} for c, keys in targets.items()
        }
        self._dotted: dict[str, dict[str, tuple[str, int]]] = {}
        self._flat: dict[str, dict[str, tuple[str, int]]] = {}
        for component, keys in self.shapes.items():
            paths = sorted({k[: -len(".weight")] for k in keys if k.endswith(".weight")})
            dotted: dict[str, tuple[str, int]] = {}
            for path in paths:
                for alias in _text_model_aliases(path):
                    _add(dotted, alias, path, DIRECT)
            for ldm, path in ldm_unet_names(paths).items():
                _add(dotted, ldm, path, LDM)
            flat: dict[str, tuple[str, int]] = {}
            for alias, (path, how) in dotted.items():
                if path != _AMBIGUOUS:
                    _add(flat, alias.replace(".", "_"), path, how)
            self._dotted[component] = dotted
            self._flat[component] = flat

    def has_component(self, component: str | None) -> bool:
        return component in self.shapes

    def resolve(self, layer: FileLayer) -> tuple[str, int] | None:
        """(layer path in the model, DIRECT or LDM), or None when the model has no such layer."""
        if layer.component not in self.shapes:
            return None
        table = self._flat if layer.flat else self._dotted
        found = table[layer.component].get(layer.name)
        if found is None or found[0] == _AMBIGUOUS:
            return None
        return found


def _text_model_aliases(path: str) -> tuple[str, ...]:
    if path.startswith(TEXT_MODEL):
        return path, path[len(TEXT_MODEL) :]
    return path, TEXT_MODEL + path


def _add(table: dict[str, tuple[str, int]], alias: str, path: str, how: int) -> None:
    old = table.get(alias)
    if old is None or old[1] > how:
        table[alias] = (path, how)
    elif old[0] != path and old[1] == how:
        table[alias] = (_AMBIGUOUS, how)
