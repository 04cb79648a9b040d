"""The two sides `sdiree bench` times: sdiree's torch-free runtime and diffusers/torch.

Each side is built in its own worker process from the bench spec (compile/bench.py writes it)
and offers one callable per figure, returning its outputs as numpy arrays. Both read their
inputs from the same file and call them by the artifact's own names, so what a family adds is
data, not code here: every text encoder of the manifest's recipe (``text_encoders``: SDXL's
two), the UNet's inputs as its ``denoise_cfg`` declares them (SDXL's added ``text_embeds`` and
``time_ids`` after the text), and the family's diffusers pipeline class for the whole image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIGURES = ("text_encoder", "unet", "vae_decode", "image")  # display order
SIDES = ("sdiree", "torch")


def image_request(manifest, spec: dict):
    """The whole-image figure's request, the same for every side that runs sdiree's pipeline."""
    from sdiree.runtime.pipeline import GenerationRequest, resolve_request

    return resolve_request(
        manifest,
        GenerationRequest(
            prompt=spec["prompt"],
            negative_prompt=spec["negative_prompt"],
            steps=spec["steps"],
            guidance_scale=spec["guidance_scale"],
            scheduler=spec["scheduler"],
            seed=spec["seed"],
        ),
    )


class SdireeSide:
    """sdiree's runtime: Session calls and Text2Image, torch-free."""

    @staticmethod
    def imports() -> None:
        import iree.runtime  # noqa: F401

        import sdiree.runtime.pipeline  # noqa: F401
        import sdiree.runtime.session  # noqa: F401

    def __init__(self, spec: dict):
        from sdiree.runtime.device_select import choose_device
        from sdiree.runtime.image_output import to_uint8
        from sdiree.runtime.manifest import load_manifest
        from sdiree.runtime.pipeline import Text2Image, pipeline_submodules
        from sdiree.runtime.session import Session

        manifest = load_manifest(Path(spec["artifact_dir"]))
        info, _ = choose_device(manifest, spec["device"])
        self.session = Session(manifest, info, pipeline_submodules(manifest, Text2Image))
        t2i = Text2Image(manifest, self.session)
        req = image_request(manifest, spec)
        x = dict(np.load(spec["inputs"]))
        call = self.session.call

        def args(sub: str, fn: str, prefix: str) -> list[np.ndarray]:
            return [x[f"{prefix}.{t.name}"] for t in self.session.decl(sub, fn).inputs]

        te = [(te["submodule"], args(te["submodule"], "encode", te["submodule"]))
              for te in spec["text_encoders"]]  # fmt: skip
        unet = args("unet", "denoise_cfg", "unet")
        self.figures = {
            "text_encoder": lambda: [o for sub, a in te for o in call(sub, "encode", *a)],
            "unet": lambda: call("unet", "denoise_cfg", *unet),
            "vae_decode": lambda: call("vae_decoder", "decode", x["vae_decode.latents"]),
            "image": lambda: [to_uint8(t2i.generate(req, progress=None).images)],
        }
        self.info = {"device": f"{info.label} ({info.name})", "scheduler": req.scheduler}
        te_subs = [sub for sub, _ in te]
        self.uses = {"text_encoder": te_subs, "unet": ["unet"], "vae_decode": ["vae_decoder"]}
        self.loaded = pipeline_submodules(manifest, Text2Image)

    def before_run(self, figure: str) -> None:
        """Give back the pages of the modules this figure does not call, as `sdiree run`
        does between its phases (Session.release): a figure's peak RSS is then its own
        module's. The whole image releases each module itself when its phase ends."""
        if figure in self.uses:
            self.session.release([s for s in self.loaded if s not in self.uses[figure]])

    def after_run(self) -> dict:
        from sdiree.runtime.device import CPU_DRIVERS

        if self.session.device_info.driver in CPU_DRIVERS:
            return {}  # the host's memory: in RSS already
        peak = device_peak_mb(self.session.device)
        return {} if peak is None else {"device_peak_mb": peak}


def device_peak_mb(device) -> float | None:
    """The HAL allocator's device-local high-water mark since the device was opened, in MiB
    (IREE keeps no resettable peak, unlike torch.cuda); None where it keeps no statistics."""
    allocator = device.allocator
    if not allocator.has_statistics:
        return None
    return allocator.statistics["device_bytes_peak"] / 2**20


def _load_pipeline(diffusers, spec: dict, dtype):
    """The family's diffusers pipeline (spec's ``pipeline_class``), with no safety checker
    where the class takes one (SD 1.x/2.x's do, SDXL's does not)."""
    import inspect

    cls = getattr(diffusers, spec["pipeline_class"])
    kwargs = {}
    if "safety_checker" in inspect.signature(cls.__init__).parameters:
        kwargs = {"safety_checker": None, "requires_safety_checker": False}
    return cls.from_pretrained(
        spec["model_dir"], torch_dtype=dtype, local_files_only=True, **kwargs
    )


class TorchSide:
    """The family's diffusers pipeline and its torch modules, eager with SDPA attention."""

    @staticmethod
    def imports() -> None:
        from .quiet import quiet_libraries

        quiet_libraries()
        import diffusers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401

    def __init__(self, spec: dict):
        import copy

        import diffusers
        import torch
        from diffusers.models.attention_processor import AttnProcessor2_0

        from .exporters.text_encoder import TextEncoderEntry
        from .exporters.unet import UNetEntry

        self.torch = torch
        dtype = getattr(torch, spec["torch_dtype"])
        device = torch.device(spec["torch_device"])
        self.cuda = device.type == "cuda"
        pipe = _load_pipeline(diffusers, spec, dtype)
        pipe.set_progress_bar_config(disable=True)
        if spec["diffusers_scheduler"]:
            cls = getattr(diffusers, spec["diffusers_scheduler"])
            pipe.scheduler = cls.from_config(pipe.scheduler.config)
        pipe.unet.set_attn_processor(AttnProcessor2_0())
        pipe.vae.set_attn_processor(AttnProcessor2_0())
        for te in spec["text_encoders"]:
            getattr(pipe, te["component"]).set_attn_implementation("sdpa")
        pipe.to(device)
        if spec["torch_compile"]:
            pipe.unet = torch.compile(pipe.unet)
        sf = pipe.vae.config.scaling_factor
        # The VAE decodes in float32 where the family's pipeline upcasts it (SDXL's fp16 VAE
        # overflows: diffusers' force_upcast), as diffusers' own pipeline does for the image.
        upcast = spec.get("vae_upcast")
        vae = pipe.vae
        if (
            upcast
            and dtype == torch.float16
            and vae.config.get(upcast["config_key"], upcast["default"])
        ):
            vae = copy.deepcopy(pipe.vae).to(torch.float32)
        x = dict(np.load(spec["inputs"]))

        def t(name, to=dtype):  # float inputs in torch's dtype (it may differ from the artifact's)
            a = torch.from_numpy(x[name]).to(device)
            return a.to(to) if a.is_floating_point() else a

        def host(o):
            o = o.detach().cpu()
            return (o.float() if o.dtype == torch.bfloat16 else o).numpy()

        # each encoder on its token embeddings with its recipe's hidden states, as exported
        te_calls = [
            (te["submodule"], te["inputs"], TextEncoderEntry(getattr(pipe, te["component"]),
                                                             te["hidden_states"]))
            for te in spec["text_encoders"]
        ]  # fmt: skip

        def text_encoder():
            outs = []
            for sub, names, call in te_calls:
                outs += [host(o) for o in call(**{n: t(f"{sub}.{n}") for n in names})]
            return outs

        unet_call = UNetEntry(pipe.unet)  # repeats the latents for both halves, as pipelines do

        def unet():
            return [host(unet_call(**{n: t(f"unet.{n}") for n in spec["unet_inputs"]}))]

        def vae_decode():
            latents = t("vae_decode.latents", vae.dtype) / sf
            return [host(vae.decode(latents, return_dict=False)[0])]

        def image():
            # The starting noise drawn as sdiree draws it (float32 from a CPU generator, then cast):
            # diffusers draws it in the pipeline's dtype, which for fp16 is other noise.
            g = torch.Generator("cpu").manual_seed(spec["seed"])
            latents = torch.randn(spec["latent_shape"], generator=g).to(device, dtype)
            out = pipe(
                spec["prompt"],
                latents=latents,
                negative_prompt=spec["negative_prompt"] or None,
                num_inference_steps=spec["steps"],
                guidance_scale=spec["guidance_scale"],
                generator=torch.Generator("cpu").manual_seed(spec["seed"]),
                height=spec["height"],
                width=spec["width"],
                output_type="np",
            ).images
            return [(out * 255).round().astype(np.uint8)]

        def no_grad(fn):
            def run():
                with torch.inference_mode():
                    return fn()

            return run

        self.figures = {
            name: no_grad(fn)
            for name, fn in (
                ("text_encoder", text_encoder),
                ("unet", unet),
                ("vae_decode", vae_decode),
                ("image", image),
            )
        }
        self.info = {
            "device": str(device),
            "dtype": spec["torch_dtype"],
            "threads": torch.get_num_threads(),
            "attention": "sdpa",
            "torch_compile": bool(spec["torch_compile"]),
            "scheduler": type(pipe.scheduler).__name__,
        }
        if self.cuda:
            self.info["device_name"] = torch.cuda.get_device_name(device)

    def before_run(self, figure: str) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def after_run(self) -> dict:
        if self.cuda:
            return {"device_peak_mb": self.torch.cuda.max_memory_allocated() / 2**20}
        return {}
