"""A1111's LoRA prompt tags: ``<lora:name:0.8>`` taken out of the prompt, the file found.

As A1111 reads them: ``<lora:NAME>`` (strength 1), ``<lora:NAME:TE>`` (one strength for
all), ``<lora:NAME:TE:UNET>`` (text encoders, UNet), or named ``te=``/``unet=``; ``<lyco:...>``
(the LyCORIS extension's tag) is the same. Tags are removed from the prompt text as A1111
does (the text around them is left as it is). Other extra-network tags (``<hypernet:...>``)
are not LoRAs and are left alone. NAME is a file ``NAME.safetensors`` in the LoRA folder or
one of its subfolders (found by name, like A1111's index), or a path relative to the folder.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

TAG = re.compile(r"<(lora|lyco):([^>]+)>")
SUFFIX = ".safetensors"
OTHER_FORMATS = (".pt", ".ckpt", ".bin", ".pth")


@dataclass(frozen=True)
class PromptLora:
    name: str
    strength: float  # the UNet's
    te_strength: float  # the text encoders'
    tag: str  # as written, for messages


def extract_prompt_loras(prompt: str) -> tuple[str, list[PromptLora]]:
    """The prompt without its LoRA tags, and the tags in prompt order."""
    found = [_parse(m.group(0), m.group(2)) for m in TAG.finditer(prompt)]
    return TAG.sub("", prompt), found


def _parse(tag: str, args: str) -> PromptLora:
    positional, named = [], {}
    for item in args.split(":"):
        if "=" in item:
            key, _, value = item.partition("=")
            named[key.strip()] = value
        else:
            positional.append(item)
    name = positional[0].strip() if positional else ""
    if not name:
        raise UserError(f"{tag}: the LoRA's name is missing (write <lora:NAME:STRENGTH>)")
    unknown = set(named) - {"te", "unet"}
    if unknown:
        raise UserError(
            f"{tag}: {', '.join(sorted(unknown))}= is not supported (only te= and unet=)"
        )
    if len(positional) > 3:
        raise UserError(f"{tag}: too many values (write <lora:NAME:STRENGTH> or NAME:TE:UNET)")
    te = _strength(tag, named.get("te", positional[1] if len(positional) > 1 else "1"))
    unet = _strength(tag, named.get("unet", positional[2] if len(positional) > 2 else te))
    return PromptLora(name, unet, te, tag)


def _strength(tag: str, value) -> float:
    if isinstance(value, float):
        return value
    try:
        s = float(value.strip())
    except ValueError:
        raise UserError(f"{tag}: strength {value.strip()!r} is not a number") from None
    if not math.isfinite(s):
        raise UserError(f"{tag}: strength {value.strip()} is not a finite number")
    return s


def resolve_lora_name(name: str, lora_dir: Path | None, tag: str | None = None) -> Path:
    """The .safetensors file a prompt tag names, in `lora_dir` or below it."""
    tag = tag or f"<lora:{name}>"
    if lora_dir is None:
        raise UserError(f"the prompt asks for {tag} but no --lora-dir was given to find it in")
    lora_dir = Path(lora_dir)
    if not lora_dir.is_dir():
        raise UserError(f"--lora-dir {lora_dir} is not a folder")
    root = lora_dir.resolve()
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    direct = (lora_dir / (stem + SUFFIX)).resolve()
    if not direct.is_relative_to(root):
        raise UserError(f"{tag}: the name leads out of --lora-dir {lora_dir}")
    if direct.is_file():
        return direct
    wanted = Path(stem).name + SUFFIX
    matches = sorted(p for p in lora_dir.rglob("*" + SUFFIX) if p.name == wanted and p.is_file())
    if "/" not in stem and len(matches) == 1:
        return matches[0].resolve()
    if "/" not in stem and len(matches) > 1:
        listed = ", ".join(str(p.relative_to(lora_dir)) for p in matches[:5])
        raise UserError(
            f"{tag}: several files in {lora_dir} are named {stem}{SUFFIX} ({listed}); name "
            "one by its path relative to the folder"
        )
    others = [direct.with_suffix(s) for s in OTHER_FORMATS if direct.with_suffix(s).is_file()]
    if others:
        raise UserError(
            f"{tag}: {others[0]} is not a .safetensors file; sdiree reads LoRAs only as "
            ".safetensors (convert it, e.g. with kohya's or diffusers' tools)"
        )
    raise UserError(f"{tag}: no {stem}{SUFFIX} in --lora-dir {lora_dir}")
