"""The `sdiree` command: a thin dispatcher that imports only what the chosen command needs (its
options are in runtime/cli_parser.py).

`compile` and `bench` need the compile extra and import it lazily; `run` and `devices` stay
torch-free. argparse (not typer/click) keeps the runtime-only install small. Every error the user
can fix, a usage error included, prints one `error: ` line on stderr and exits non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError

from .cli_parser import INSTALL_HINT, USAGE_EXIT, build_parser
from .errors import UserError
from .sizes import parse_sizes

# The compile extra's modules, as imported (importlib.util.find_spec names).
COMPILE_MODULES = ("torch", "iree.turbine", "iree.compiler", "diffusers", "transformers")
# ... and as installed (their distribution names, whose versions compile records).
COMPILE_DISTRIBUTIONS = ("torch", "iree-turbine", "iree-base-compiler", "diffusers", "transformers")


def compile_extra_hint(command: str, missing: str) -> str:
    return (
        f"sdiree {command} needs the compile extra (torch, iree-turbine, iree-base-compiler, "
        f"diffusers, transformers), which is not installed ({missing}): {INSTALL_HINT}"
    )


def _missing_compile_modules() -> list[str]:
    missing = []
    for name in COMPILE_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _compile_side_error(command: str, e: ImportError | PackageNotFoundError) -> UserError:
    # ImportError.name is the module that failed: one of sdiree's own means a broken or
    # half-updated install of sdiree itself, not a missing extra.
    name = getattr(e, "name", None) or ""
    if isinstance(e, ImportError) and name.split(".")[0] == "sdiree":
        return UserError(
            f"sdiree {command}: sdiree's own module {name} does not import ({e}); reinstall "
            f"sdiree: {INSTALL_HINT}"
        )
    return UserError(compile_extra_hint(command, str(e)))


def _import_compile_side(command: str, module: str, names: tuple[str, ...]):
    """The named objects of sdiree.compile.<module>, or a UserError saying how to install them."""
    missing = _missing_compile_modules()
    if missing:
        raise UserError(compile_extra_hint(command, "missing: " + ", ".join(missing)))
    # A package that imports but has no metadata (a broken install) fails later, inside a
    # library's own import checks (transformers asks for torch's version), with their words.
    from importlib.metadata import version

    try:
        for dist in COMPILE_DISTRIBUTIONS:
            version(dist)
    except PackageNotFoundError as e:
        raise UserError(compile_extra_hint(command, f"no package metadata for {e}")) from None
    try:
        mod = importlib.import_module(f"sdiree.compile.{module}")
    except (ImportError, PackageNotFoundError) as e:
        raise _compile_side_error(command, e) from e
    return [getattr(mod, n) for n in names]


def _call_compile_side(command: str, fn, options) -> None:
    # The compile side looks up package versions and imports heavy modules lazily, so a broken
    # or partial compile extra can still surface here.
    try:
        fn(options)
    except (ImportError, PackageNotFoundError) as e:
        raise _compile_side_error(command, e) from e


def cmd_compile(a: argparse.Namespace) -> None:
    options_cls, compile_model = _import_compile_side(
        "compile", "driver", ("CompileOptions", "compile_model")
    )
    options = options_cls(
        model_dir=a.model_dir,
        target=a.target,
        arch=a.arch,
        dtype=a.dtype,
        height=a.height,
        width=a.width,
        batch_size=a.batch_size,
        out=a.out,
        specs_dir=a.specs,
        vae_tile=a.vae_tile,
        config_dir=a.config,
        prediction_type=a.prediction_type,
        vae=a.vae,
        sizes=parse_sizes(a.sizes) if a.sizes else (),
    )
    _call_compile_side("compile", compile_model, options)


def cmd_devices(a: argparse.Namespace) -> None:
    from .device import CPU_DRIVERS, available_drivers, list_devices

    for driver in available_drivers():
        if driver in CPU_DRIVERS:
            print(f"{driver:<11} host CPU")
            continue
        found = list_devices(driver)
        if not found:
            print(f"{driver:<11} (no device)")
        for d in found:
            kind = "CPU implementation" if d.is_cpu_emulation else d.kind.upper()
            print(f"{d.label:<11} {d.name}  [{kind}]")
            if driver == "vulkan":
                _print_vulkan_fit(d.name)


def _print_vulkan_fit(name: str) -> None:
    """What a Vulkan device reports, and the vulkan-spirv arch presets it runs."""
    from .arch_fit import fitting_arches
    from .targets import load_registry
    from .vulkan_caps import caps_for

    caps = caps_for(name)
    if caps is None:
        return
    target = load_registry().target("vulkan-spirv")
    fits = fitting_arches(target, caps)
    fp16 = " (fp32 only)" if fits and not fitting_arches(target, caps, "fp16") else ""
    print(f"{'':<11} {caps.summary()}")
    print(f"{'':<11} runs --arch {', '.join(fits) or 'baseline'}{fp16}")


def cmd_run(a: argparse.Namespace) -> None:
    from .generate import generate_to_files

    generate_to_files(
        artifact_dir=a.artifact_dir,
        prompt=a.prompt,
        negative_prompt=a.negative_prompt,
        steps=a.steps,
        guidance_scale=a.guidance_scale,
        scheduler=a.scheduler,
        seed=a.seed,
        num_images=a.num_images,
        width=a.width,
        height=a.height,
        device=a.device,
        output=a.output,
        overwrite=a.overwrite,
        force_device=a.force_device,
        vae_tiling=a.vae_tiling,
        vae_memory_mib=a.vae_memory,
        weights=a.weights,
        vae=a.vae,
        loras=a.lora,
        lora_dir=a.lora_dir,
        embeddings=a.embedding,
        init_image=a.init_image,
        mask=a.mask,
        strength=a.strength,
        resize=a.resize,
    )


def cmd_bench(a: argparse.Namespace) -> None:
    default_prompt, options_cls, run_bench = _import_compile_side(
        "bench", "bench", ("DEFAULT_PROMPT", "BenchOptions", "run_bench")
    )
    options = options_cls(
        model_dir=a.model_dir,
        target=a.target,
        arch=a.arch,
        dtype=a.dtype,
        height=a.height,
        width=a.width,
        steps=a.steps,
        runs=a.runs,
        warmup=a.warmup,
        json_path=a.json_path,
        torch_compile=a.torch_compile,
        torch_device=a.torch_device,
        torch_dtype=a.torch_dtype,
        out=a.out,
        device=a.device,
        prompt=a.prompt or default_prompt,
        seed=a.seed,
        specs_dir=a.specs,
        peers=a.peers,
        in_turn=a.in_turn,
        back_to_back=a.back_to_back,
    )
    _call_compile_side("bench", run_bench, options)


COMMANDS = {"compile": cmd_compile, "run": cmd_run, "devices": cmd_devices, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the command's parser, so the hint names `sdiree <command> --help`
        args.command_parser.error("unrecognized arguments: " + " ".join(unknown))
    if args.command is None:
        parser.print_help(sys.stderr)
        sys.exit(USAGE_EXIT)
    try:
        COMMANDS[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(0)


if __name__ == "__main__":
    main()
