"""What `sdiree bench` calls for an artifact, read from its manifest and family, not its name.

The shared inputs file holds each call's inputs under "<figure or submodule>.<input name>": every
text encoder of the manifest's recipe under its own submodule (SD 1.x/2.x: one; SDXL: two, their
outputs both in the text-encoder figure), the UNet's `denoise_cfg` inputs as it declares them
(SDXL's `text_embeds` and `time_ids` after the text), the VAE decoder's latents. The torch side
gets from the family registry its diffusers pipeline class and each encoder's component.
"""

from __future__ import annotations

import numpy as np


def bench_calls(manifest) -> dict[tuple[str, str], tuple[str, ...]]:
    """(submodule, function) -> the names of its inputs in the shared inputs file, in call order:
    each text encoder of the recipe under its own submodule name, the UNet's `denoise_cfg` inputs
    as it declares them (SDXL's added conditioning included), the VAE decoder's latents."""
    from sdiree.runtime.conditioning import text_encoder_submodules

    def names(sub: str, fn: str, prefix: str) -> tuple[str, ...]:
        return tuple(f"{prefix}.{t.name}" for t in manifest.submodules[sub].functions[fn].inputs)

    calls = {
        (sub, "encode"): names(sub, "encode", sub) for sub in text_encoder_submodules(manifest)
    }
    calls["unet", "denoise_cfg"] = names("unet", "denoise_cfg", "unet")
    calls["vae_decoder", "decode"] = ("vae_decode.latents",)
    return calls


def bench_inputs(manifest, calls: dict, seed: int) -> dict[str, np.ndarray]:
    """The inputs both sides call, drawn once (verify.make_inputs) and shared through a file."""
    from .verify import make_inputs

    inputs = {}
    for (sub, fn), names in calls.items():
        inputs.update(zip(names, make_inputs(manifest, sub, fn, seed), strict=True))
    return inputs


def family_spec(manifest) -> dict:
    """What the torch side needs from the artifact's family: its diffusers pipeline class (the
    registry's first, text-to-image), each text encoder's component, inputs and hidden states,
    the UNet's input names, and whether the family's pipeline upcasts the VAE."""
    from sdiree.runtime.families import load_families

    fam = load_families().family(manifest.family)
    encoders = []
    for te in manifest.data["text_encoders"]:
        sub = te.get("submodule", "text_encoder")
        decl = manifest.submodules[sub].functions["encode"]
        encoders.append(
            {
                "submodule": sub,
                "component": fam.submodules[sub]["component"],
                "inputs": [t.name for t in decl.inputs],
                "hidden_states": te.get("hidden_states", "last"),
            }
        )
    unet = manifest.submodules["unet"].functions["denoise_cfg"]
    return {
        "pipeline_class": fam.pipeline_classes[0],
        "text_encoders": encoders,
        "unet_inputs": [t.name for t in unet.inputs],
        "vae_upcast": fam.vae_upcast,
    }


def figure_outputs(manifest) -> dict[str, list[str]]:
    """Each figure's output names, for parity; several text encoders' outputs are named by
    their submodule ("text_encoder_2.penultimate_hidden_state")."""
    from sdiree.runtime.conditioning import text_encoder_submodules

    def outs(sub: str, fn: str) -> list[str]:
        return [o.name for o in manifest.submodules[sub].functions[fn].outputs]

    encoders = text_encoder_submodules(manifest)
    text = [
        name if len(encoders) == 1 else f"{sub}.{name}"
        for sub in encoders
        for name in outs(sub, "encode")
    ]
    return {
        "text_encoder": text,
        "unet": outs("unet", "denoise_cfg"),
        "vae_decode": outs("vae_decoder", "decode"),
        "image": ["pixels"],
    }
