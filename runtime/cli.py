"""The `sdiree` command: a thin argparse dispatcher that imports only what the chosen command needs.

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
from pathlib import Path

from . import __version__, schedulers
from .errors import UserError
from .sizes import parse_sizes

USAGE_EXIT = 2
# The compile extra's modules, as imported (importlib.util.find_spec names).
COMPILE_MODULES = ("torch", "iree.turbine", "iree.compiler", "diffusers", "transformers")
# ... and as installed (their distribution names, whose versions compile records).
COMPILE_DISTRIBUTIONS = ("torch", "iree-turbine", "iree-base-compiler", "diffusers", "transformers")
INSTALL_HINT = "pip install 'sdiree[compile]' (from a source checkout: pip install -e '.[compile]')"


def compile_extra_hint(command: str, missing: str) -> str:
    return (
        f"sdiree {command} needs the compile extra (torch, iree-turbine, iree-base-compiler, "
        f"diffusers, transformers), which is not installed ({missing}): {INSTALL_HINT}"
    )


class _Parser(argparse.ArgumentParser):
    """Usage errors as one `error: ` line that points at --help, instead of usage + message."""

    def error(self, message: str):
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(USAGE_EXIT)


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


def _target_options(p: argparse.ArgumentParser) -> None:
    """The options `compile` and `bench` share: what to compile for."""
    p.add_argument(
        "model_dir",
        metavar="MODEL_DIR",
        type=Path,
        help="diffusers model folder (holds model_index.json), or a single-file "
        ".safetensors/.ckpt checkpoint",
    )
    p.add_argument("--target", "-t", required=True, help="cpu, vulkan-spirv, rocm or cuda")
    p.add_argument("--arch", help="chip preset of the target (see specs/)")
    p.add_argument("--dtype", help="fp32, fp16, or bf16 on cpu (default: per target)")
    p.add_argument("--height", type=int, metavar="N", help="image height (default: the model's)")
    p.add_argument("--width", type=int, metavar="N", help="image width (default: the model's)")


def _command(sub, name: str, help: str, description: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=description, allow_abbrev=False)
    p.set_defaults(command_parser=p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sdiree",
        description="Ahead-of-time compiled Stable Diffusion on IREE.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"sdiree {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    parser.set_defaults(command_parser=parser)

    p = _command(
        sub,
        "compile",
        help="compile an SD 1.x/2.x model (needs the compile extra)",
        description="Compile an SD 1.x/2.x model (a diffusers folder, or a single-file "
        ".safetensors/.ckpt checkpoint) into IREE modules, parameters and a manifest. Needs "
        "the compile extra: " + INSTALL_HINT,
    )
    _target_options(p)
    p.add_argument(
        "--batch-size", "-b", type=int, metavar="N", default=1, help="images per prompt (1)"
    )
    p.add_argument("--out", "-o", type=Path, metavar="DIR", help="artifact directory")
    p.add_argument(
        "--specs", type=Path, metavar="DIR", help="another specs directory (tuning work)"
    )
    p.add_argument(
        "--sizes",
        metavar="WxH,...",
        help="more image sizes the artifact runs at besides --width/--height, e.g. "
        "512x768,768x512 (each adds UNet and VAE functions sharing the weights)",
    )
    p.add_argument(
        "--vae-tile",
        type=int,
        metavar="PX",
        help="VAE tile side for images larger than it, a multiple of 32 (default: the VAE's "
        "sample_size, 512 for SD 1.5; 0: never tile)",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="DIR",
        help="for a single-file checkpoint: a diffusers folder of its architecture whose "
        "configs, tokenizer and scheduler to use (default: the shipped ones of its family)",
    )
    p.add_argument(
        "--vae",
        type=Path,
        metavar="FILE",
        help="compile another VAE's weights in (.safetensors: original or diffusers layout)",
    )
    p.add_argument(
        "--prediction-type",
        choices=("epsilon", "v_prediction", "sample"),
        help="for a single-file checkpoint: what its UNet predicts (default: epsilon; SD 2.x: "
        "v_prediction at 768, as diffusers; epsilon picks SD 2.x-base's 512 config)",
    )
    p.set_defaults(func=cmd_compile)

    p = _command(
        sub,
        "run",
        help="make an image from a prompt with a compiled artifact (torch-free)",
        description="Make an image from a prompt with a compiled artifact (torch-free).",
    )
    p.add_argument(
        "artifact_dir",
        metavar="ARTIFACT_DIR",
        type=Path,
        help="artifact directory (holds manifest.json)",
    )
    p.add_argument("--prompt", "-p", required=True, metavar="TEXT", help="what to draw")
    p.add_argument("--negative-prompt", "-n", default="", metavar="TEXT", help="what to avoid")
    p.add_argument(
        "--steps", type=int, metavar="N", help="denoising steps (default: per scheduler)"
    )
    p.add_argument(
        "--guidance-scale", "-g", type=float, default=7.5, metavar="X", help="CFG scale (7.5)"
    )
    p.add_argument(
        "--scheduler",
        metavar="NAME",
        help="default: the model's own; one of (other names it accepts): "
        + schedulers.choices_help(),
    )
    p.add_argument(
        "--seed", type=int, metavar="N", help="default or -1: random, printed and stored in the PNG"
    )
    p.add_argument("--num-images", type=int, metavar="N", default=1, help="images to make (1)")
    p.add_argument(
        "--width", type=int, metavar="N", help="one of the compiled sizes' (default: the main)"
    )
    p.add_argument(
        "--height", type=int, metavar="N", help="one of the compiled sizes' (default: the main)"
    )
    p.add_argument(
        "--device", "-d", metavar="DEVICE", help="local-task, vulkan, vulkan:N, or part of a name"
    )
    p.add_argument(
        "--output",
        "-o",
        type=Path,
        metavar="PNG",
        default=Path("sdiree.png"),
        help="PNG path (sdiree.png)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace existing files")
    p.add_argument("--force-device", action="store_true", help="skip the arch check")
    p.add_argument(
        "--vae-tiling",
        metavar="MODE",
        default="auto",
        help="auto: decode in tiles where the artifact's VAE was compiled for them (sdiree "
        "compile --vae-tile); on: the same, asked outright; off: refuse a tiled artifact",
    )
    p.add_argument(
        "--vae-memory",
        type=int,
        metavar="MIB",
        help="working memory one VAE call may take; refused up front where the artifact's "
        "VAE tile (or whole image) needs more (recompile with a smaller --vae-tile)",
    )
    p.add_argument(
        "--weights",
        type=Path,
        metavar="FILE",
        help="another checkpoint of the artifact's architecture (a fine-tune: .safetensors, "
        ".ckpt, or a diffusers folder), loaded instead of the compiled weights",
    )
    p.add_argument(
        "--vae", type=Path, metavar="FILE", help="another VAE (.safetensors; original or diffusers)"
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FILE[:X]",
        help="merge a LoRA (kohya, PEFT, LoHa, LoKr) at strength X (1.0); repeatable; also "
        "<lora:NAME:X> in the prompt, found in --lora-dir",
    )
    p.add_argument(
        "--lora-dir", type=Path, metavar="DIR", help="where <lora:NAME> prompt tags are found"
    )
    p.add_argument(
        "--embedding",
        action="append",
        default=[],
        metavar="FILE[:TOKEN]",
        help="a textual-inversion embedding (A1111 .pt/.safetensors: called in the prompt by "
        "the file's name as a word or as <name>; diffusers learned_embeds: by the token it "
        "holds; SDXL clip_l/clip_g files: each set into its own text encoder), or called by "
        "TOKEN; repeatable",
    )
    p.add_argument(
        "--init-image",
        type=Path,
        metavar="IMAGE",
        help="img2img: start from this image (PNG; JPEG, WebP... with Pillow installed)",
    )
    p.add_argument(
        "--mask",
        type=Path,
        metavar="IMAGE",
        help="inpaint: repaint the init image where this image is white (>= 128), keep the rest",
    )
    p.add_argument(
        "--strength",
        type=float,
        metavar="X",
        help="how much of the schedule repaints the init image, in (0, 1] (img2img 0.8, inpaint 1)",
    )
    p.add_argument(
        "--resize",
        choices=("crop", "fit", "stretch"),
        help="bring an init image of another size to the artifact's: crop (cover, cut the "
        "middle), fit (fit inside, repeat the edges), stretch (default: refuse)",
    )
    p.set_defaults(func=cmd_run)

    p = _command(
        sub,
        "devices",
        help="list IREE drivers and devices",
        description="List IREE drivers and devices (Vulkan devices with their type, the "
        "properties they report and the vulkan-spirv arch presets they run).",
    )
    p.set_defaults(func=cmd_devices)

    p = _command(
        sub,
        "bench",
        help="time sdiree against diffusers/torch (needs the compile extra)",
        description="Time sdiree against diffusers/torch on the same work: one row per figure. "
        "Needs the compile extra: " + INSTALL_HINT,
    )
    _target_options(p)
    p.add_argument(
        "--steps", type=int, metavar="N", default=20, help="steps of the whole-image figure (20)"
    )
    p.add_argument("--runs", type=int, metavar="N", default=5, help="timed runs per figure (5)")
    p.add_argument(
        "--warmup", type=int, metavar="N", default=2, help="untimed warm-up runs per figure (2)"
    )
    p.add_argument(
        "--back-to-back",
        type=int,
        metavar="N",
        default=2,
        help="calls a run makes in a row, the last one timed: a denoising loop's steady state (2)",
    )
    p.add_argument(
        "--json", dest="json_path", type=Path, metavar="FILE", help="report (ARTIFACT/bench.json)"
    )
    p.add_argument("--torch-compile", action="store_true", help="torch.compile the UNet")
    p.add_argument("--torch-device", help="torch's device: cpu or cuda (default: per target)")
    p.add_argument("--torch-dtype", help="fp32, fp16 or bf16 (default: the artifact's)")
    p.add_argument(
        "--out", "-o", type=Path, metavar="DIR", help="artifact directory (compiled or reused)"
    )
    p.add_argument("--device", "-d", metavar="DEVICE", help="sdiree device (as for `run`)")
    p.add_argument("--prompt", "-p", metavar="TEXT", help="prompt of the whole-image figure")
    p.add_argument(
        "--seed", type=int, metavar="N", default=42, help="seed of the inputs and the image (42)"
    )
    p.add_argument(
        "--specs", type=Path, metavar="DIR", help="another specs directory (tuning work)"
    )
    p.add_argument(
        "--peers",
        metavar="LIST",
        help="also time these CPU engines, comma-separated: openvino (= openvino-f32 and "
        "openvino-default), openvino-f32, openvino-default, onnxruntime (needs the peers extra: "
        "pip install 'sdiree[peers]')",
    )
    p.add_argument(
        "--in-turn",
        action="store_true",
        help="run one side's worker at a time, through every figure, instead of alternating "
        "call by call (for models whose sides do not fit in memory together, e.g. SDXL fp32)",
    )
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the command's parser, so the hint names `sdiree <command> --help`
        args.command_parser.error("unrecognized arguments: " + " ".join(unknown))
    if args.command is None:
        parser.print_help(sys.stderr)
        sys.exit(USAGE_EXIT)
    try:
        args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(0)


if __name__ == "__main__":
    main()
