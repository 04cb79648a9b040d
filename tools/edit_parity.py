"""img2img and inpainting parity: sdiree's pipelines against diffusers'
StableDiffusionImg2ImgPipeline and StableDiffusionInpaintPipeline.

Same model folder, init image, mask, strength, seed (CPU generator), scheduler, steps, guidance
and prompts; the 8-bit images are compared by PSNR. Used by the tests and by hand:

    python tools/edit_parity.py ARTIFACT_DIR MODEL_DIR --init-image in.png [--mask m.png] \\
        --strength 0.6 --scheduler euler --steps 20 --seed 42
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parity import DIFFUSERS_SCHEDULERS, psnr  # noqa: E402


def pattern_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """An HxWx3 uint8 init image with shapes and gradients (not noise), deterministic."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=2)
    for _ in range(4):
        cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(4, height / 3)
        inside = (y - cy) ** 2 + (x - cx) ** 2 < r * r
        img[inside] = rng.uniform(0, 255, 3)
    return img.round().astype(np.uint8)


def pattern_mask(height: int, width: int) -> np.ndarray:
    """An HxW uint8 mask: a white rectangle (repainted) on black, with a gray band of values
    around 128 so the binarisation threshold is exercised."""
    mask = np.zeros((height, width), np.uint8)
    mask[height // 4 : 3 * height // 4, width // 3 : width - 4] = 255
    mask[: height // 8, : width // 2] = 128  # exactly 0.502: repainted
    mask[height - height // 8 :, : width // 2] = 127  # 0.498: kept
    return mask


def torch_artifact(model_dir, out_dir, batch: int = 1) -> Path:
    """A stand-in artifact directory for TorchModules: the manifest a compile of the model
    folder at its default size would write (functions, shapes, family, pipeline), with its
    tokenizer and scheduler config, and no modules."""
    import json
    import shutil

    from sdiree.compile.model_source import open_model
    from sdiree.runtime.families import load_families
    from sdiree.runtime.manifest import SCHEMA_VERSION

    model = open_model(model_dir)
    out = Path(out_dir)
    shutil.copytree(Path(model_dir) / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    shutil.copytree(Path(model_dir) / "scheduler", out / "scheduler", dirs_exist_ok=True)
    cfg = {c: model.config(c) for c in ("unet", "vae", "text_encoder")}
    factor = 2 ** (len(cfg["vae"]["block_out_channels"]) - 1)
    lh = lw = cfg["unet"]["sample_size"]
    c_lat, c_in = cfg["vae"].get("latent_channels", 4), cfg["unet"]["in_channels"]
    length, dim = (
        cfg["text_encoder"].get("max_position_embeddings", 77),
        cfg["text_encoder"]["hidden_size"],
    )

    def t(name, shape, dtype="float32"):
        return {"name": name, "shape": list(shape), "dtype": dtype}

    def fn(inputs, outputs):
        return {"inputs": inputs, "outputs": outputs}

    image = t("image", (batch, 3, lh * factor, lw * factor))
    latents = (batch, c_lat, lh, lw)
    unet_fn = {
        name: fn(
            [t("sample", (batch, c_in, lh, lw)), t("timestep", (1,)),
             t("encoder_hidden_states", (b, length, dim))],
            [t("noise_pred", (b, c_lat, lh, lw))],
        )
        for name, b in (("denoise_cfg", 2 * batch), ("denoise", batch))
    }  # fmt: skip
    subs = {
        "text_encoder": {"encode": fn([t("input_ids", (batch, length), "int64")], [])},
        "unet": unet_fn,
        "vae_decoder": {"decode": fn([t("latents", latents)], [image])},
        "vae_encoder": {
            "encode": fn([image], [t("latent_mean", latents), t("latent_std", latents)])
        },
    }
    data = {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "name": Path(model_dir).name,
            "family": model.family.name,
            "pipeline": load_families().pipeline_for(model.family, cfg),
        },
        "target": {"name": "torch", "arch": "cpu", "driver": "local-task"},
        "dtype": "fp32",
        "image": {
            "height": lh * factor, "width": lw * factor, "batch_size": batch,
            "latent_channels": c_lat, "latent_height": lh, "latent_width": lw,
        },
        "vae_scaling": {"factor": cfg["vae"].get("scaling_factor", 0.18215)},
        "text_encoders": [{"submodule": "text_encoder", "tokenizer": "tokenizer"}],
        "scheduler": {"config": "scheduler/scheduler_config.json"},
        "submodules": {
            sub: {"vmfb": f"{sub}.vmfb", "functions": f} for sub, f in subs.items()
        },
        "files": {},
    }  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(data, indent=1))
    return out


class TorchModules:
    """sdiree's Session.call contract answered by the model folder's torch modules in fp32,
    through the exporters' entry modules: the numpy pipelines checked without a compile."""

    def __init__(self, model_dir, manifest):
        from sdiree.compile.exporters import COMPONENTS
        from sdiree.compile.exporters.text_encoder import TextEncoderEntry
        from sdiree.compile.exporters.unet import UNetEntry
        from sdiree.compile.exporters.vae import VaeDecodeEntry, VaeEncodeEntry
        from sdiree.compile.model_source import open_model

        model = open_model(model_dir)
        sf = manifest.data["vae_scaling"]["factor"]
        entries = {
            "text_encoder": TextEncoderEntry,
            "unet": UNetEntry,
            "vae_decoder": lambda m: VaeDecodeEntry(m, sf),
            "vae_encoder": lambda m: VaeEncodeEntry(m, sf),
        }
        loaded = {}
        self.entries = {}
        for sub, make in entries.items():
            comp = COMPONENTS[sub]
            if comp not in loaded:
                loaded[comp] = model.load(comp).eval()
            self.entries[sub] = make(loaded[comp])
        text_encoder = loaded["text_encoder"]
        self._ids_text_encoder = lambda ids: tuple(text_encoder(ids, return_dict=False)[:2])
        self.calls: list[tuple[str, str, tuple]] = []

    def call(self, submodule: str, function: str, *args: np.ndarray) -> list[np.ndarray]:
        import torch

        self.calls.append((submodule, function, tuple(a.shape for a in args)))
        tensors = [torch.from_numpy(np.asarray(a)) for a in args]
        entry = self.entries[submodule]
        if submodule == "text_encoder" and len(tensors) == 1:  # ids: before the embeds input
            entry = self._ids_text_encoder
        with torch.no_grad():
            outs = entry(*tensors)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return [o.float().numpy() for o in outs]


def diffusers_edit_images(
    model_dir,
    scheduler,
    steps,
    guidance,
    seed,
    prompt,
    negative,
    n,
    init_image: np.ndarray,
    mask: np.ndarray | None,
    strength: float,
    per_image_seeds: bool = False,
):
    """uint8 NHWC images from diffusers on the CPU, fp32, given PIL images as a user would.

    Inpainting with per_image_seeds is made image by image (diffusers with a list of generators
    encodes the one init image with the first generator only; sdiree's image i is diffusers'
    image of seed + i alone)."""
    import diffusers
    import torch
    from PIL import Image

    cls = diffusers.StableDiffusionImg2ImgPipeline
    if mask is not None:
        cls = diffusers.StableDiffusionInpaintPipeline
    pipe = cls.from_pretrained(
        model_dir, safety_checker=None, requires_safety_checker=False, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    cls_name, overrides = DIFFUSERS_SCHEDULERS[scheduler]
    pipe.scheduler = getattr(diffusers, cls_name).from_config(pipe.scheduler.config, **overrides)
    h, w = init_image.shape[:2]
    kwargs = {"image": Image.fromarray(init_image), "strength": strength}
    if mask is not None:
        kwargs.update(mask_image=Image.fromarray(mask), height=h, width=w)

    def run(count, generator):
        out = pipe(
            prompt,
            negative_prompt=negative or None,
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=generator,
            num_images_per_prompt=count,
            output_type="np",
            **kwargs,
        ).images
        return (out * 255).round().astype(np.uint8)

    def gen(s):
        return torch.Generator("cpu").manual_seed(s)

    if not per_image_seeds:
        return run(n, gen(seed))
    if mask is not None:
        return np.concatenate([run(1, gen(seed + i)) for i in range(n)])
    return run(n, [gen(seed + i) for i in range(n)])


def sdiree_edit_images(
    artifact_dir,
    scheduler,
    steps,
    guidance,
    seed,
    prompt,
    negative,
    n,
    init_image: np.ndarray,
    mask: np.ndarray | None,
    strength: float | None,
    device=None,
    per_image_seeds=False,
    session=None,
):
    """uint8 NHWC images from sdiree's pipeline; ``session`` replaces the compiled modules
    (e.g. the torch modules, to check the numpy side alone)."""
    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.image_output import to_uint8
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.pipeline import (
        GenerationRequest,
        pipeline_class,
        pipeline_submodules,
        resolve_request,
    )
    from sdiree.runtime.session import with_fresh_device_on_loss

    manifest = load_manifest(artifact_dir)
    req = resolve_request(
        manifest,
        GenerationRequest(
            prompt, negative, steps, guidance, scheduler, seed, n,
            per_image_seeds=per_image_seeds, init_image=init_image, mask=mask, strength=strength,
        ),
    )  # fmt: skip
    cls = pipeline_class(req)
    if session is not None:
        result = cls(manifest, session).generate(req, progress=None)
    else:
        info, _ = choose_device(manifest, device)
        result = with_fresh_device_on_loss(
            manifest,
            info,
            pipeline_submodules(manifest, cls),
            lambda s: cls(manifest, s).generate(req, progress=None),
            warn=lambda msg: print(f"warning: {msg}", file=sys.stderr),
        )
    return to_uint8(result.images), manifest


def main(argv=None) -> int:
    from sdiree.runtime.image_input import load_edit_images
    from sdiree.runtime.manifest import load_manifest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact_dir", type=Path)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--init-image", type=Path, help="default: a test pattern")
    ap.add_argument("--mask", type=Path)
    ap.add_argument("--test-mask", action="store_true", help="inpaint with a test mask")
    ap.add_argument("--strength", type=float, default=0.6)
    ap.add_argument("--scheduler", default="euler")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance-scale", type=float, default=7.5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--prompt", default="a lighthouse at dusk")
    ap.add_argument("--negative-prompt", default="")
    ap.add_argument("--num-images", type=int, default=1)
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    img = load_manifest(a.artifact_dir).image
    h, w = img["height"], img["width"]
    if a.init_image:
        edit = load_edit_images(a.init_image, a.mask, w, h)
        image, mask = edit.image, edit.mask
    else:
        image, mask = pattern_image(h, w), None
    if a.test_mask:
        mask = pattern_mask(h, w)
    args = (a.scheduler, a.steps, a.guidance_scale, a.seed, a.prompt, a.negative_prompt)
    ours, _ = sdiree_edit_images(
        a.artifact_dir, *args, a.num_images, image, mask, a.strength, a.device
    )
    ref = diffusers_edit_images(a.model_dir, *args, a.num_images, image, mask, a.strength)
    kind = "inpaint" if mask is not None else "img2img"
    print(f"{kind} PSNR {psnr(ours, ref):.2f} dB ({a.scheduler}, {a.steps} steps, seed {a.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
