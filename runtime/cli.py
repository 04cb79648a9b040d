"""The `sdiree` command: a thin dispatcher that imports only what the chosen command needs.

`compile` needs the compile extra and imports it lazily; `run` and `devices` stay torch-free.
Errors the user can fix print one line and exit non-zero, without a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Ahead-of-time compiled Stable Diffusion on IREE.",
    pretty_exceptions_enable=False,
)

COMPILE_EXTRA_HINT = (
    "sdiree compile needs the compile extra (torch, iree-turbine, iree-base-compiler, diffusers, "
    "transformers): pip install 'sdiree[compile]'"
)


@app.callback()
def _root() -> None:
    """Ahead-of-time compiled Stable Diffusion on IREE."""


def fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


@app.command("compile")
def compile_cmd(
    model_dir: Path = typer.Argument(..., help="diffusers model folder (holds model_index.json)"),
    target: str = typer.Option(..., "--target", "-t", help="cpu, vulkan-spirv, rocm or cuda"),
    arch: str = typer.Option(None, "--arch", help="chip preset of the target (see specs/)"),
    dtype: str = typer.Option(None, "--dtype", help="fp32 or fp16 (default: per target)"),
    height: int = typer.Option(None, "--height", help="image height (default: the model's)"),
    width: int = typer.Option(None, "--width", help="image width (default: the model's)"),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="images per prompt"),
    out: Path = typer.Option(None, "--out", "-o", help="artifact directory"),
    specs: Path = typer.Option(None, "--specs", help="another specs directory (tuning work)"),
) -> None:
    """Compile a diffusers SD 1.x model into IREE modules, parameters and a manifest."""
    try:
        from sdiree.compile.driver import CompileOptions, compile_model
    except ImportError as e:
        fail(f"{COMPILE_EXTRA_HINT} ({e})")
    try:
        compile_model(
            CompileOptions(
                model_dir=model_dir,
                target=target,
                arch=arch,
                dtype=dtype,
                height=height,
                width=width,
                batch_size=batch_size,
                out=out,
                specs_dir=specs,
            )
        )
    except UserError as e:
        fail(str(e))


def main() -> None:
    try:
        app()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
