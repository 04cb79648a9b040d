"""One exporter per submodule: text encoder, UNet, VAE decoder and encoder.

`plan_for` maps a submodule name to its exporter with the shapes, dtype and export choices of a
compile; `scope_for` names the parameter scope (the VAE's two halves share one).
"""

from __future__ import annotations

import dataclasses

from sdiree.runtime.registry_schema import UNET_ONLY_EXPORT

# Bump when an exporter traces a different graph for the same model and choices (it is part of
# the MLIR cache key). 2: Winograd weights computed at export, as parameters of their own;
# 3: Winograd transforms with fewer traced ops; 4: GroupNorm in float32 for half precision, and
# the `pointwise_einsum` conv choice; 5: chunked attention as 2-D matmuls per head; 6: `denoise_cfg`
# takes the latents once, and the UNet's layers before the text enters run once for both halves;
# 7: under `sdpa`, layers with `upcast_attention` (SD 2.x) attend in fp32; 8: the VAE encoder
# returns the latent std beside the mean, so img2img and inpainting sample as diffusers does;
# 9: the text encoder takes token embeddings and the end-of-text positions instead of ids
# (textual-inversion embeddings at run time, runtime/text_inputs.py); 10: under `matmul_kernel:
# amx`, attention as one fused kernel dispatch, batched Winograd products and im2col matmuls on
# the AMX kernel, and under `linear: amx` a GEGLU as one kernel dispatch; 11: under
# `matmul_kernel: amx`, 3x3 convs on the AMX conv kernel (channels padded), cross-attention on the
# fused kernel, heads in place, text rows padded for the kernel, GEGLU's result kept in bf16;
# 12: under `matmul_kernel: amx` with channels-last layouts, GroupNorm (+ SiLU) on its kernels
# (group_norm_kernel.py), written as the conv kernel's padded bf16 input, the transformer
# blocks' LayerNorms on a kernel too (layer_norm_kernel.py), both giving bf16, and the conv
# kernel's epilogue writing only real pixels with the bias, time embedding and skip added;
# 13: the AMX kernels' ops take `split` (export choice `amx_operands`); 14: a split matmul's
# block chosen by its operands' whole depth; 15: the fused attention takes the real key count
# (every cross-attention on the kernel, no mask column) and writes bf16 without split; 16: it
# takes q in f32 as the projection wrote it (its workgroups scale, cast and pad their rows);
# 17: under `winograd_kernel: fused`, each fused Winograd conv call its own function; 18: under
# `matmul_kernel: f32`, the im2col convs' matmuls on the fp32 kernel, bias in its epilogue, and
# under `winograd_kernel: fused` the F(2x2) convs on the fp32 Winograd kernels; 19: channels-last
# GroupNorm statistics in one pass of sums about a reference; 20: the AMX attention's keys and
# values packed from the projections by the kernel's own pass (pack_kv); 21: the AMX matmul's
# bias in its accumulators (linears, im2col convs); 22: Winograd products and im2col matmuls
# whose rows are not a multiple of 32 padded onto the AMX kernel, as the linears' were; 23: under
# `matmul_kernel: amx` channels-last, nearest 2x upsampling on its kernel (upsample_kernel.py);
# 24: the fp32 linear kernel's grid takes up to 96 rows in one row block (linear_f32.block_for).
EXPORTER_REVISION = 24
# Bumped when weights derived at export (Winograd) are computed differently, so that cached
# derived archives written before are written again (compile/params_stage.py). 2: rounded once
# to the export dtype; before, an fp16 file compiled in fp32 had its transformed weights rounded
# to fp16 first (relative error ~1e-3, and no exact read-back for pruning).
DERIVED_REVISION = 2

SCOPES = {
    "text_encoder": "text_encoder",
    "text_encoder_2": "text_encoder_2",
    "unet": "unet",
    "vae_decoder": "vae",
    "vae_encoder": "vae",
}
COMPONENTS = {
    "text_encoder": "text_encoder",
    "text_encoder_2": "text_encoder_2",
    "unet": "unet",
    "vae_decoder": "vae",
    "vae_encoder": "vae",
}


def kernels_for(options: dict) -> dict[str, str]:
    """The hand-written kernels (specs/kernels) an export with these choices links, {name: sha256
    of its source}: part of the export's cache key."""
    from ..kernel_objects import source_hash
    from . import (
        amx_matmul,
        attention_amx,
        attention_f32,
        group_norm_kernel,
        linear_f32,
        upsample_kernel,
        winograd_f32,
        winograd_fused,
    )

    names = [amx_matmul.KERNEL] if uses_amx(options) else []
    if options.get("matmul_kernel") == "amx":
        names += [attention_amx.KERNEL, group_norm_kernel.KERNEL, upsample_kernel.KERNEL]
        if options.get("winograd_kernel") == "fused":
            names.append(winograd_fused.KERNEL)
    if options.get("attention") == "fused_f32":
        names.append(attention_f32.KERNEL)
    if options.get("linear") == "f32" or options.get("matmul_kernel") == "f32":
        names.append(linear_f32.KERNEL)
    if options.get("matmul_kernel") == "f32" and options.get("winograd_kernel") == "fused":
        names.append(winograd_f32.KERNEL)
    return {name: source_hash(name) for name in names}


def ensure_kernels(options: dict) -> None:
    """Build the kernels' objects that an export with these choices names, where the user cache
    lost them (a cached export names them by path: compile/kernel_objects.py)."""
    from . import (
        amx_matmul,
        attention_amx,
        attention_f32,
        group_norm_kernel,
        linear_f32,
        winograd_f32,
        winograd_fused,
    )

    if options.get("attention") == "fused_f32":
        attention_f32.object_path()
    if options.get("linear") == "f32" or options.get("matmul_kernel") == "f32":
        linear_f32.object_path()
    if options.get("matmul_kernel") == "f32" and options.get("winograd_kernel") == "fused":
        winograd_f32.object_path()
    isa = kernel_isa(options)
    if uses_amx(options):
        amx_matmul.object_path(amx_matmul.KERNEL, isa)
    if options.get("matmul_kernel") == "amx":
        amx_matmul.object_path(attention_amx.KERNEL, isa)
        amx_matmul.object_path(group_norm_kernel.KERNEL, isa)
        if options.get("winograd_kernel") == "fused":
            amx_matmul.object_path(winograd_fused.KERNEL, isa)


def uses_amx(options: dict) -> bool:
    """Whether an export with these choices links sdiree's kernels (the `amx` ones, whichever
    their `kernel_isa`)."""
    return options.get("linear") == "amx" or options.get("matmul_kernel") == "amx"


def kernel_isa(options: dict) -> str:
    """The instruction set of the kernels an export links (export choice `kernel_isa`)."""
    return options.get("kernel_isa", "amx")


# the CPU features sdiree's kernels execute per `kernel_isa` (the manifest's `cpu_requires`): the
# AVX-512 of their epilogues and products (kernels/amx_support.h), and AMX's tiles for `amx`
# (every CPU with AMX has the AVX-512 so far)
AVX512_FEATURES = ("avx512_bf16", "avx512bw", "avx512dq", "avx512f", "avx512vl")
KERNEL_FEATURES = {
    "amx": ("amx_bf16", "amx_tile", *AVX512_FEATURES),
    "avx512_bf16": AVX512_FEATURES,
}


def cpu_requires(options_by_submodule) -> list[str]:
    """The CPU features the modules of an export need beyond what iree's own code checks: those
    of the hand-written kernels they link."""
    from .attention_f32 import CPU_FEATURES as F32_ATTENTION_FEATURES
    from .linear_f32 import CPU_FEATURES as F32_LINEAR_FEATURES

    need = set()
    for o in options_by_submodule:
        if uses_amx(o):
            need.update(KERNEL_FEATURES[kernel_isa(o)])
        if o.get("attention") == "fused_f32":
            need.update(F32_ATTENTION_FEATURES)
        if o.get("linear") == "f32" or o.get("matmul_kernel") == "f32":
            need.update(F32_LINEAR_FEATURES)
    return sorted(need)


def scope_for(submodule: str) -> str:
    return SCOPES[submodule]


def added_conditioning(plan) -> dict[str, int] | None:
    """The UNet's inputs besides the text, {name: width per image}, from the family's
    `unet_conditioning` (SDXL: the pooled projection of the second text encoder and two ids
    per entry of `time_ids`); None where the UNet takes the text only."""
    spec = plan.family.unet_conditioning
    if not spec:
        return None
    pooled = plan.configs[spec["text_embeds"]]["projection_dim"]
    return {"text_embeds": pooled, "time_ids": 2 * len(spec["time_ids"])}


def plan_for(builder, submodule: str):
    """The ExportPlan of one submodule for the builder's compile plan."""
    from .amx_matmul import set_split
    from .linear_flat import set_linear_lowering
    from .linear_panels import DERIVED_TAG as PANELS_TAG
    from .norm_precision import set_norm_sums

    model = builder.torch_model(COMPONENTS[submodule])
    options = builder.export_options(submodule)
    if options.get("amx_operands", "bf16") == "bf16x3":
        set_split(model)  # the AMX kernels' operands as two bf16 parts each (amx_matmul.py)
    linear = options.get("linear", "native")
    rebound = set_linear_lowering(model, linear)
    sums = options.get("norm_sums", "whole")
    if sums != "whole" and options.get("layout", "native") != "native":
        raise ValueError(f"export norm_sums {sums} applies to layout native only")
    set_norm_sums(model, sums)  # before the exporters make the other GroupNorms float32
    xplan = _plan_for(builder, submodule, model)
    if linear == "panels" and rebound:
        xplan.derived = f"{xplan.derived}+{PANELS_TAG}" if xplan.derived else PANELS_TAG
    return xplan


def _plan_for(builder, submodule: str, model):
    from .base import TORCH_DTYPES
    from .text_encoder import plan_text_encoder
    from .unet import plan_unet
    from .vae import plan_vae_decoder, plan_vae_encoder

    p = builder.plan
    dtype = TORCH_DTYPES[p.submodule_export_dtype(submodule)]
    options = builder.export_options(submodule)
    attention = options.get("attention", "sdpa")
    conv = options.get("conv", "native")
    shared = {  # the UNet's and the VAE's
        "winograd_output": options.get("winograd_output", "batched"),
        "winograd_split_min_side": options.get("winograd_split_min_side"),
        "attention_block_bytes": options.get("attention_block_bytes"),
        "matmul_kernel": options.get("matmul_kernel", "iree"),
    }
    encoders = {te["submodule"]: te for te in p.family.text_encoders}
    max_length = p.configs[p.family.text_encoders[0]["submodule"]].get(
        "max_position_embeddings", 77
    )
    if submodule in encoders:
        recipe = encoders[submodule]
        return plan_text_encoder(
            model,
            submodule=submodule,
            batch=p.batch_size,
            max_length=p.configs[submodule].get("max_position_embeddings", 77),
            dtype=dtype,
            attention=attention,
            hidden_states=recipe.get("hidden_states", "last"),
            pooled=recipe.get("pooled", "pooled_output"),
        )
    if submodule == "unet":
        return plan_unet(
            model,
            batch=p.batch_size,
            latent_hws=p.latent_hws,
            text_len=max_length,
            text_dim=p.configs["unet"]["cross_attention_dim"],
            dtype=dtype,
            attention=attention,
            conv=conv,
            **shared,
            winograd4_min_side=options.get("winograd4_min_side"),
            plain_from_downscale=options.get("plain_from_downscale"),
            added_conditioning=added_conditioning(p),
            transformer=options.get("transformer", "native"),
            layout=options.get("layout", "native"),
            direct_convs=options.get("direct_convs", "wide"),
            winograd_kernel=options.get("winograd_kernel", "none"),
        )
    for key in UNET_ONLY_EXPORT:
        if key in options:
            raise ValueError(f"export option {key} applies to the unet, not {submodule}")
    vae_plan = plan_vae_decoder if submodule == "vae_decoder" else plan_vae_encoder
    if submodule == "vae_decoder":  # the registry allows `layout` here and for the unet only
        shared["layout"] = options.get("layout", "native")
    # The whole image, or one entry function per tile shape (compile/plan.py); the main
    # function keeps its name, the others are named for their input's height and width.
    plans = [
        vae_plan(
            model,
            batch=p.batch_size,
            image_hw=hw,
            dtype=dtype,
            attention=attention,
            conv=conv,
            **shared,
        )
        for hw in p.vae_image_shapes()
    ]
    main = plans[0]
    for extra in plans[1:]:
        (fn,) = extra.functions
        h, w = fn.inputs[0].shape[-2:]
        main.functions.append(dataclasses.replace(fn, name=f"{fn.name}_{h}x{w}"))
    return main
