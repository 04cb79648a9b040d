"""The original (LDM/SGM) names of a diffusers UNet's layers, derived from its own keys.

Some trainers write kohya LoRAs against the original UNet (``input_blocks.4.1``, ``middle_block``,
``output_blocks``, resnets' ``in_layers.2``) rather than diffusers' (``down_blocks.1.attentions.0``,
``conv1``). The block numbering depends on the architecture (resnets per block, which blocks
attend, where the down/upsamplers are), so it is counted from the diffusers keys the artifact
holds, not taken from a table of one model family.

Original layout, per diffusers down block k with resnets 0..n-1: each resnet j takes one
``input_blocks.{i}`` (resnet at ``.0``, its attention at ``.1``), then the downsampler takes one of
its own (``input_blocks.{i}.0.op``); ``input_blocks.0.0`` is conv_in. Up block k: each resnet j one
``output_blocks.{o}`` (resnet ``.0``, attention ``.1``), the upsampler sitting in the last one
after them (``.1.conv`` or ``.2.conv``). The middle block is resnet, attention, resnet.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# Inside a resnet: diffusers name -> original name.
_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
# Layers outside the blocks.
_TOP = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_PART = re.compile(
    r"^(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)"
)
_MID = re.compile(r"^mid_block\.(resnets|attentions)\.(\d+)")


def _block_structure(paths: Iterable[str]) -> dict[tuple[str, int], dict[str, set[int]]]:
    """{("down_blocks", k): {"resnets": {0, 1}, "attentions": {0, 1}, "downsamplers": {0}}}."""
    blocks: dict[tuple[str, int], dict[str, set[int]]] = {}
    for path in paths:
        m = _PART.match(path)
        if m:
            kind, k, part, j = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
            blocks.setdefault((kind, k), {}).setdefault(part, set()).add(j)
    return blocks


def _prefix_map(paths: list[str]) -> dict[str, tuple[str, bool]]:
    """{diffusers prefix: (original prefix, is a resnet)} for every block part of the UNet."""
    blocks = _block_structure(paths)
    out: dict[str, tuple[str, bool]] = {}
    i = 1
    for k in sorted(k for kind, k in blocks if kind == "down_blocks"):
        parts = blocks[("down_blocks", k)]
        for j in sorted(parts.get("resnets", ())):
            out[f"down_blocks.{k}.resnets.{j}"] = (f"input_blocks.{i}.0", True)
            if j in parts.get("attentions", ()):
                out[f"down_blocks.{k}.attentions.{j}"] = (f"input_blocks.{i}.1", False)
            i += 1
        if parts.get("downsamplers"):
            out[f"down_blocks.{k}.downsamplers.0.conv"] = (f"input_blocks.{i}.0.op", False)
            i += 1
    mids = {(m.group(1), int(m.group(2))) for p in paths if (m := _MID.match(p))}
    if ("resnets", 0) in mids:
        out["mid_block.resnets.0"] = ("middle_block.0", True)
    if ("attentions", 0) in mids:
        out["mid_block.attentions.0"] = ("middle_block.1", False)
    if ("resnets", 1) in mids:
        out["mid_block.resnets.1"] = ("middle_block.2", True)
    o = 0
    for k in sorted(k for kind, k in blocks if kind == "up_blocks"):
        parts = blocks[("up_blocks", k)]
        resnets = sorted(parts.get("resnets", ()))
        for j in resnets:
            attends = j in parts.get("attentions", ())
            out[f"up_blocks.{k}.resnets.{j}"] = (f"output_blocks.{o}.0", True)
            if attends:
                out[f"up_blocks.{k}.attentions.{j}"] = (f"output_blocks.{o}.1", False)
            if j == resnets[-1] and parts.get("upsamplers"):
                slot = 2 if attends else 1
                out[f"up_blocks.{k}.upsamplers.0.conv"] = (f"output_blocks.{o}.{slot}.conv", False)
            o += 1
    return out


def ldm_unet_names(paths: Iterable[str]) -> dict[str, str]:
    """{original name: diffusers name} for the layer paths (keys without .weight/.bias) of a
    diffusers UNet; paths with no original counterpart are left out. Empty for a model
    without UNet blocks."""
    paths = list(paths)
    prefixes = _prefix_map(paths)
    if not prefixes:
        return {}
    out: dict[str, str] = {}
    for path in paths:
        if path in _TOP:
            out[_TOP[path]] = path
            continue
        for prefix in _prefixes_of(path):
            if prefix in prefixes:
                ldm, resnet = prefixes[prefix]
                rest = path[len(prefix) :]
                if resnet and rest:
                    head, _, tail = rest[1:].partition(".")
                    if head not in _RESNET:
                        break
                    rest = "." + _RESNET[head] + (f".{tail}" if tail else "")
                out[ldm + rest] = path
                break
    return out


def _prefixes_of(path: str) -> list[str]:
    """ "a.b.c" -> ["a.b.c", "a.b", "a"] (longest first)."""
    parts = path.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
