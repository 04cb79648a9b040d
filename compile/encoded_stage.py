"""The compile's encoded-parameter stage, for targets that encode their parameters: a
submodule compiled with its weight transforms split into an encoder module
(compile/param_encoder.py), the encoder run once into `<submodule>.encoded.irpa` beside the
vmfb and kept (`<submodule>.encoder.vmfb`: the runtime runs it on other weights), and the
layout it packs each weight in learned (runtime/weights/layout.py), so a LoRA is re-packed in
numpy. The driver's Builder (compile/driver.py) calls it with itself."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from sdiree.runtime.fileutil import sha256_file, temp_path_for

from .build_cache import CACHED

if TYPE_CHECKING:
    from .driver import Builder


def _encoder_driver(b: Builder) -> str:
    """The IREE driver the parameter encoder runs on: the target's own unless it names
    another (GPU targets: the host CPU)."""
    return b.plan.target.encoder_driver or b.plan.target.driver


def _encoder_module_flags(b: Builder, flags: list[str]) -> list[str]:
    """The encoder module's iree-compile flags: the module's, or the target's encoder
    flags where its encoder runs elsewhere."""
    return list(b.plan.target.encoder_flags) if b.plan.target.encoder_driver else flags


def compile_encoded(
    b: Builder,
    submodule: str,
    mlir: Path,
    mkey: str,
    spec,
    archives: list[Path],
    flags: list[str],
    log: Path,
) -> dict | None:
    """Compile submodule with its weight transforms split into an encoder module, run that
    once, and keep its output beside the vmfb (`<submodule>.encoded.irpa`). The encoder is
    kept too (`<submodule>.encoder.vmfb`): the runtime runs it on other weights (`sdiree run
    --weights/--lora`). Returns the archive's manifest entry, or None when there was nothing
    to precompute."""
    from sdiree.runtime.weights.archive import Archive

    from .encoder_chain import compile_encoder
    from .exporters import scope_for
    from .iree_compile import compile_mlir
    from .param_encoder import encoder_flags, loads_with, run_encoder
    from .tuning_embed import with_spec

    out = b.plan.out
    vmfb = out / f"{submodule}.vmfb"
    encoded = out / f"{submodule}.encoded.irpa"
    encoder = out / f"{submodule}.encoder.vmfb"
    scope = f"{submodule}_encoded"
    enc_mlir = temp_path_for(out / f"{submodule}.encoder.mlir")
    enc_vmfb = temp_path_for(encoder)
    try:
        cached = b.modules.fetch(mkey, {"vmfb": vmfb, "encoder": enc_vmfb})
        if cached is not None:
            b.r.reused("compile", submodule, CACHED)
            has_encoder = "encoder" in cached
        else:
            with b.r.stage("compile", submodule), with_spec(mlir, spec, out) as src:
                both = [*flags, *encoder_flags(enc_mlir, scope)]
                b.said_rewritten(submodule, compile_mlir(src, vmfb, both, log, b.f16_ops))
            has_encoder = enc_mlir.is_file()
            if not has_encoder:
                b.modules.store(mkey, {"vmfb": vmfb})
        if not has_encoder:
            encoded.unlink(missing_ok=True)
            encoder.unlink(missing_ok=True)
            return None
        with b.r.stage("encode", submodule):
            if cached is None:  # compiled just now: its encoder too
                # from stdin: the encoder MLIR's temp path would land in the module
                from_stdin = functools.partial(compile_mlir, from_stdin=True)
                compile_encoder(
                    enc_mlir, enc_vmfb, _encoder_module_flags(b, flags), log, from_stdin
                )
                b.modules.store(mkey, {"vmfb": vmfb, "encoder": enc_vmfb})
            count = run_encoder(
                enc_vmfb,
                [(scope_for(submodule), a) for a in archives],
                scope,
                encoded,
                _encoder_driver(b),
            )
        if count:
            enc_vmfb.replace(encoder)
    finally:
        enc_mlir.unlink(missing_ok=True)
        enc_vmfb.unlink(missing_ok=True)
    if count == 0:
        encoded.unlink(missing_ok=True)
        encoder.unlink(missing_ok=True)
        return None
    # Weights derived at export usually reach the module only through the encoder; then the
    # artifact does not need their archive at run time.
    needed = [(scope_for(submodule), archives[0]), (scope, encoded)]
    # (loaded on the target's device: without derived archives there is nothing to ask,
    # and a GPU target's device need not be here)
    needs_derived = len(archives) > 1 and not loads_with(vmfb, needed, b.plan.target.driver)
    # What the encoder reads besides the model's weights: the runtime recomputes these from
    # replaced weights (their archive is not in the artifact).
    derived = {}
    for archive in archives[1:]:
        for key, e in Archive(archive).entries.items():
            derived[key] = {"shape": list(e.shape), "dtype": e.dtype.name}
    entry = {
        "path": encoded.name,
        "scope": scope,
        "sha256": sha256_file(encoded),
        "needs_derived": needs_derived,
        "encoder": {"vmfb": encoder.name, "sha256": sha256_file(encoder), "derived": derived},
    }
    if b.plan.target.encoder_driver:
        entry["encoder"]["driver"] = b.plan.target.encoder_driver
    return entry


def add_layout(b: Builder, submodule: str, enc: dict, archives: list[Path]) -> None:
    """Learn the layout of the encoded entry enc into it (see learn_layout): what a LoRA
    re-packs in numpy (weights/repack.py), and what the artifact's pruned archives are
    read back by (prune.py)."""
    out = b.plan.out
    layout = out / f"{submodule}.layout.json"
    encoder = enc["encoder"]
    if b.export_options(submodule).get("amx_operands") == "bf16x3":
        encoder["layout_tried"] = True
        # each weight's lo part is computed from it (w - bf16(w), rounded), not laid out,
        # and the raw weight cannot be read back from its two parts
        b.r.say(
            f"{submodule}: its encoded weights are two bf16 parts each (amx_operands "
            "bf16x3), not a layout of them: its original archive is kept, and a LoRA on "
            "it runs the encoder"
        )
        return
    need, free = _layout_disk(b, enc, archives)
    if need > free:  # not marked tried: the next compile learns it
        b.r.say(
            f"{submodule}: its layout is not learned now: that takes ~{need / 2**30:.1f} GiB of "
            f"temp disk in {out}, {free / 2**30:.1f} GiB free there. The artifact works "
            "without it (its original archive kept whole, a LoRA on it runs the encoder); "
            "free space and compile again to learn it"
        )
        return
    with b.r.stage("layout", submodule):
        learn_layout(
            b, submodule, out / encoder["vmfb"], archives, encoder["derived"],
            out / enc["path"], enc["scope"], layout,
        )  # fmt: skip
    encoder["layout_tried"] = True
    if layout.is_file():
        encoder.update(layout=layout.name, layout_sha256=sha256_file(layout))


def _layout_disk(b: Builder, enc: dict, archives: list[Path]) -> tuple[int, int]:
    """(temp disk learning enc's layout takes, free disk where it is written), in bytes."""
    from sdiree.runtime.weights.layout import narrow_dtype
    from sdiree.runtime.weights.repack import learning_disk

    derived = {k: (v["shape"], v["dtype"]) for k, v in enc["encoder"]["derived"].items()}
    encoded = b.plan.out / enc["path"]
    return learning_disk(archives[:1], derived, encoded, narrow_dtype(b.plan.dtype), b.plan.out)


def learn_layout(b: Builder, submodule, encoder, archives, derived, encoded, scope, layout):
    """Learn how encoder packs each weight (weights/layout.py) and save it at layout, so a
    LoRA is re-packed in numpy from its first use; nothing saved when it cannot be learned
    (the runtime then runs the encoder)."""
    from sdiree.runtime.weights.encoder import driver_device
    from sdiree.runtime.weights.layout import narrow_dtype
    from sdiree.runtime.weights.layout_learn import BUDGET_ENV, budget_s
    from sdiree.runtime.weights.repack import learn_layout as learn_packing

    from .exporters import scope_for

    learned = learn_packing(
        encoder,
        archives[:1],
        {k: (v["shape"], v["dtype"]) for k, v in derived.items()},
        encoded,
        scope_for(submodule),
        scope,
        driver_device(_encoder_driver(b)),
        temp_path_for(layout.with_suffix(".irpa")),
        derived_archives=archives[1:],
        narrow=narrow_dtype(b.plan.dtype),
    )
    if learned is None:
        layout.unlink(missing_ok=True)
    else:
        if learned.gave_up:
            b.r.say(
                f"{submodule}: its encoder's layout was not learned within "
                f"${BUDGET_ENV} ({budget_s():.0f} s): saved as incomplete, so its original "
                "archive is not pruned and a LoRA on it runs the encoder"
            )
        learned.save(layout)


def encoder_intact(b: Builder, encoded: dict | None) -> bool:
    """The kept encoder of an encoded build is in place (builds before it was kept: rebuild)."""
    if not encoded:
        return True
    enc = encoded.get("encoder")
    if not (enc and b.intact(b.plan.out / enc["vmfb"], enc["sha256"])):
        return False
    layout = enc.get("layout")  # builds before layouts were learned at compile: none
    return layout is None or b.intact(b.plan.out / layout, enc["layout_sha256"])


def layout_tried(encoded: dict, out: Path) -> bool:
    """Whether the encoder's layout was learned for good (Layout.settled: one an older learner
    left incomplete, a bf16 artifact's, is learned again), or tried where none can be."""
    from sdiree.runtime.weights.layout import Layout

    enc = encoded["encoder"]
    if not enc.get("layout"):
        return bool(enc.get("layout_tried"))
    learned = Layout.load(out / enc["layout"])
    return learned is not None and learned.settled
