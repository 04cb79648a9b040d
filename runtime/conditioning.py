"""Prompt → the UNet's conditioning inputs, as the artifact's family recipe makes them.

Every text encoder of the manifest's `text_encoders` encodes the prompt with its own tokenizer;
their hidden states (the layer the recipe names: the exporter returns it) are joined along the
feature axis, so SD 1.x/2.x's one encoder gives its hidden states unchanged and SDXL's two give
diffusers' 768 + 1280 = 2048 features. A manifest with `conditioning` (SDXL) adds the UNet's
other inputs as diffusers' StableDiffusionXLPipeline makes them: `text_embeds`, the pooled
output of the encoder it names, and `time_ids`, (original size, crop top-left, target size) =
(H, W, 0, 0, H, W) for a text-to-image call at the artifact's size. Where `zero_empty_negative`
is set (model_index.json's force_zeros_for_empty_prompt), an empty negative prompt is zeros in
place of its text and pooled embeddings, the time ids kept. What the UNet takes is read from its
`denoise` signature, so the values come out in its order and dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import UserError
from .manifest import Manifest
from .text_inputs import EncodedText, TextInputs

# diffusers' names of the pairs in SDXL's time ids, for a text-to-image call of H x W pixels.
TIME_ID_PAIRS = {
    "original_size": lambda h, w: (h, w),
    "crops_coords_top_left": lambda h, w: (0, 0),
    "target_size": lambda h, w: (h, w),
}


def text_encoder_count(manifest: Manifest) -> int:
    return len(manifest.data["text_encoders"])


def text_encoder_submodules(manifest: Manifest) -> tuple[str, ...]:
    return tuple(te.get("submodule", "text_encoder") for te in manifest.data["text_encoders"])


class Conditioner:
    """Encodes prompts into the UNet's inputs after the latents and timestep (one row per
    compiled batch row: the `denoise` entry's shapes)."""

    def __init__(self, manifest: Manifest, session, text_inputs: Sequence[TextInputs]):
        self.session = session
        self.text_inputs = tuple(text_inputs)
        self.submodules = text_encoder_submodules(manifest)
        if len(self.text_inputs) != len(self.submodules):
            raise ValueError(
                f"{len(self.text_inputs)} text inputs for {len(self.submodules)} text encoders"
            )
        self.extra = manifest.data.get("conditioning") or {}
        self.unet_inputs = manifest.submodules["unet"].functions["denoise"].inputs[2:]
        names = [t.name for t in self.unet_inputs]
        known = {"encoder_hidden_states", *(["text_embeds", "time_ids"] if self.extra else [])}
        if set(names) - known:
            raise UserError(
                f"{manifest.root}: the UNet takes {', '.join(sorted(set(names) - known))}, which "
                "this sdiree does not make; run it with the sdiree that compiled it"
            )
        img = manifest.image
        self.set_image_size(img["height"], img["width"])

    def set_image_size(self, height: int, width: int) -> None:
        """The size (px) of the images made next: SDXL's time ids name it (an artifact
        compiled for several sizes, `sdiree compile --sizes`, makes any of them)."""
        self.time_ids = self._time_ids(self.extra.get("time_ids", ()), height, width)

    @staticmethod
    def _time_ids(pairs, h: int, w: int) -> np.ndarray:
        unknown = [p for p in pairs if p not in TIME_ID_PAIRS]
        if unknown:
            raise UserError(
                f"the artifact's UNet takes time ids {unknown} this sdiree does not know; run it "
                "with the sdiree that compiled it"
            )
        return np.array([v for p in pairs for v in TIME_ID_PAIRS[p](h, w)], dtype=np.float32)

    @property
    def zero_empty_negative(self) -> bool:
        return bool(self.extra.get("zero_empty_negative"))

    def encode(self, text: str) -> tuple[tuple[np.ndarray, ...], EncodedText]:
        """The UNet inputs for text, and the first encoder's EncodedText (its truncation and
        the embeddings it called)."""
        encoded = [ti.encode(text) for ti in self.text_inputs]
        hidden, pooled = [], {}
        for sub, ti, enc in zip(self.submodules, self.text_inputs, encoded, strict=True):
            h, p = self.session.call(sub, "encode", *ti.arguments(enc))
            hidden.append(h)
            pooled[sub] = p
        values = {
            "encoder_hidden_states": hidden[0]
            if len(hidden) == 1
            else np.concatenate(hidden, axis=-1)
        }
        if self.extra:
            rows = hidden[0].shape[0]
            values["text_embeds"] = pooled[self.extra["text_embeds"]]
            values["time_ids"] = np.broadcast_to(self.time_ids, (rows, self.time_ids.size))
        return self._ordered(values), encoded[0]

    def zeros_like(self, cond: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """The negative conditioning of an empty negative prompt under zero_empty_negative:
        zero text and pooled embeddings, the same time ids."""
        return tuple(
            c if t.name == "time_ids" else np.zeros_like(c)
            for t, c in zip(self.unet_inputs, cond, strict=True)
        )

    def _ordered(self, values: dict) -> tuple[np.ndarray, ...]:
        return tuple(
            np.ascontiguousarray(values[t.name].astype(t.dtype, copy=False))
            for t in self.unet_inputs
        )
