"""What the `sdiree` command line accepts: its commands and their options, as one argparse
parser (`build_parser`) whose parse names the command (`args.command`) for runtime/cli.py to
dispatch. Nothing here imports more than the runtime's own small modules, so `sdiree --help`
and a usage error stay fast on a runtime-only install."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__, schedulers

USAGE_EXIT = 2
INSTALL_HINT = "pip install 'sdiree[compile]' (from a source checkout: pip install -e '.[compile]')"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one `error: ` line that points at --help, instead of usage + message."""

    def error(self, message: str):
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(USAGE_EXIT)


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
        help="compile an SD 1.x, SD 2.x or SDXL model (needs the compile extra)",
        description="Compile an SD 1.x, SD 2.x or SDXL model (a diffusers folder, or a single-file "
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

    p = _command(
        sub,
        "devices",
        help="list IREE drivers and devices",
        description="List IREE drivers and devices (Vulkan devices with their type, the "
        "properties they report and the vulkan-spirv arch presets they run).",
    )

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
    return parser
