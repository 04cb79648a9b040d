"""Compose manifest.json (schema in sdiree.runtime.manifest) from a finished build.

Every path it names is relative to the artifact directory and inside it: the artifact is
self-contained. A submodule's `mlir` is the name of its exported MLIR in the compile cache
(see compile/driver.py), recorded for reference only; the runtime never reads it.
"""

from __future__ import annotations

from pathlib import Path

from sdiree.runtime.families import load_families
from sdiree.runtime.fileutil import sha256_file
from sdiree.runtime.manifest import SCHEMA_VERSION

from .exporters import cpu_requires, scope_for


def _rel(path: Path, root: Path) -> str:
    """path relative to root; a ValueError, not a `../` path, when it is outside."""
    return Path(path).relative_to(root).as_posix()


def _text_encoder_entry(plan, recipe: dict) -> dict:
    """One text encoder of the family's recipe (specs/families.json), with its config's sizes."""
    cfg = plan.configs[recipe["submodule"]]
    hidden = recipe.get("hidden_states", "last")
    return {
        "submodule": recipe["submodule"],
        "max_length": cfg.get("max_position_embeddings", 77),
        "hidden_size": cfg["hidden_size"],
        "tokenizer": recipe["tokenizer"],
        "pooled": recipe["pooled"],
        # the last layer's unless it says otherwise (manifests of SD 1.x/2.x leave it out)
        **({"hidden_states": hidden} if hidden != "last" else {}),
        # configs with CLIP's old eos_token_id 2 pool at the largest id (transformers' rule):
        # the end token, or a textual-inversion token past the vocabulary where a prompt has one
        **({"pooled_at": "largest_id"} if cfg.get("eos_token_id") == 2 else {}),
    }


def _family_fields(plan) -> dict:
    """What a family adds to the manifest beside the text encoders: the UNet's added
    conditioning and how an empty negative prompt is encoded (`conditioning`), and which dtype
    the VAE was compiled in where the family's policy decides it (`vae_precision`)."""
    family, fields = plan.family, {}
    if family.unet_conditioning:
        zero = family.zero_empty_negative or {}
        flag = plan.model.index.get(zero["index_key"], zero["default"]) if zero else False
        fields["conditioning"] = {
            "text_embeds": family.unet_conditioning["text_embeds"],
            "time_ids": list(family.unet_conditioning["time_ids"]),
            "zero_empty_negative": flag is True,
        }
    if family.vae_upcast:
        key = family.vae_upcast["config_key"]
        fields["vae_precision"] = {
            "dtype": plan.submodule_export_dtype("vae_decoder"),
            "upcast": plan.vae_upcast,
            "config": {key: plan.configs["vae"].get(key, family.vae_upcast["default"])},
        }
    return fields


def _source_file(model_dir: Path) -> dict:
    from .single_file import source_info

    info = source_info(model_dir)
    if info is None:
        return {}
    return {"file": {k: info[k] for k in ("file", "sha256", "format") if k in info}}


def _layout(path: Path) -> dict:
    """{"layout": "pages"} for a paged archive (sdiree.runtime.weights.pages), else {}."""
    import iree.runtime as rt

    from sdiree.runtime.weights.pages import paged_layout

    index = rt.ParameterIndex()
    index.load(str(path))
    return {"layout": "pages"} if paged_layout(index) is not None else {}


def build_manifest(builder, results: dict, signatures: dict, runtime_files: dict) -> dict:
    plan = builder.plan
    out = plan.out
    arch = plan.target.arch(plan.arch)
    files: dict[str, str] = {}
    submodules = {}
    for sub, res in results.items():
        vmfb_rel = _rel(out / f"{sub}.vmfb", out)
        files[vmfb_rel] = res["vmfb_sha256"]
        params, enc = res["params"], res.get("encoded")  # params: the archives it loads
        archives = [(_rel(path, out), sha, scope_for(sub)) for path, sha in params]
        encoder = None
        if enc:
            archives.append((enc["path"], enc["sha256"], enc["scope"]))
            files[enc["encoder"]["vmfb"]] = enc["encoder"]["sha256"]
            encoder = {
                "vmfb": enc["encoder"]["vmfb"],
                "scope": enc["scope"],
                "derived": enc["encoder"]["derived"],
            }
            if enc["encoder"].get("driver"):  # runs elsewhere than the modules (schema 6)
                encoder["driver"] = enc["encoder"]["driver"]
            if enc["encoder"].get("layout"):
                encoder["layout"] = enc["encoder"]["layout"]
                files[enc["encoder"]["layout"]] = enc["encoder"]["layout_sha256"]
        for rel, sha, _ in archives:
            files[rel] = sha
        submodules[sub] = {
            "vmfb": vmfb_rel,
            "parameters": archives[0][0],
            "scope": archives[0][2],
            "extra_parameters": [
                {"path": rel, "scope": scope, **_layout(out / rel)}
                for rel, _, scope in archives[1:]
            ],
            # the kept parameter encoder: what `sdiree run --weights/--lora` re-encodes with
            **({"encoder": encoder} if encoder else {}),
            "mlir": res["mlir"].name,
            "export": builder.export_options(sub),
            "functions": signatures[sub],
            "flags": res["flags"],
            "tuning_specs": res["tuning_specs"],
        }
    for rel_name, path in runtime_files.items():
        files[rel_name] = sha256_file(path)

    family = plan.family
    vae_cfg = plan.configs["vae"]
    return {
        "schema_version": SCHEMA_VERSION,
        "sdiree_version": builder.versions["sdiree"],
        "iree_compiler_version": builder.versions["iree-base-compiler"],
        "versions": builder.versions,
        "model": {
            "name": plan.model.name,
            "source": str(plan.model.path.resolve()),
            "family": family.name,
            "pipeline": load_families().pipeline_for(family, plan.configs),
            "pipeline_class": plan.model.index.get("_class_name"),
            "content_hash": builder.model_hash,
            # the single-file checkpoint it was converted from: its sha256 is A1111's hash
            **_source_file(plan.model.path),
            # --vae: the VAE file compiled in, for the PNG's "VAE" and "VAE hash"
            **(
                {"vae": {"file": plan.vae_file.name, "sha256": builder.vae_sha256}}
                if plan.vae_file is not None
                else {}
            ),
        },
        "target": {
            "name": plan.target.name,
            "arch": plan.arch,
            "arch_description": arch.description,
            "arch_cpu_emulated": arch.cpu_emulated,
            # what a device must offer to run these modules (the runtime checks it)
            **({"device_requires": arch.device} if arch.device else {}),
            # CPU features the linked kernels execute (sdiree's AMX kernel; the runtime checks)
            **(
                {"cpu_requires": needs}
                if (needs := cpu_requires(builder.export_options(sub) for sub in plan.submodules))
                else {}
            ),
            "driver": plan.target.driver,
            "export": dict(plan.target.export),
        },
        "dtype": plan.dtype,
        "image": {
            "height": plan.height,
            "width": plan.width,
            "batch_size": plan.batch_size,
            # the UNet's out_channels: an inpainting UNet takes 9 in (latents, mask, image)
            "latent_channels": plan.configs["vae"].get("latent_channels", 4),
            "latent_height": plan.latent_hw[0],
            "latent_width": plan.latent_hw[1],
            "vae_scale_factor": plan.vae_factor,
            # `--sizes`: every size the artifact runs at, the main one first
            **(
                {"sizes": [{"height": h, "width": w} for h, w in plan.sizes]}
                if plan.extra_sizes
                else {}
            ),
        },
        "vae_scaling": {
            "factor": vae_cfg.get("scaling_factor", 0.18215),
            "applied_by": "module",
            "note": "vae_decoder divides latents by the factor; vae_encoder multiplies the "
            "mean and std",
        },
        "text_encoders": [_text_encoder_entry(plan, te) for te in family.text_encoders],
        **_family_fields(plan),
        "scheduler": {
            "config": "scheduler/scheduler_config.json",
            "class": plan.model.index.get("scheduler", [None, None])[1],
        },
        "submodules": submodules,
        "files": files,
        "build": {"model_hash": builder.model_hash},
    }
