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
    dtype: str = typer.Option(
        None, "--dtype", help="fp32, fp16, or bf16 on cpu (default: per target)"
    ),
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


@app.command("devices")
def devices_cmd() -> None:
    """List IREE drivers and devices (Vulkan devices with their type)."""
    from .device import CPU_DRIVERS, available_drivers, list_devices

    for driver in available_drivers():
        if driver in CPU_DRIVERS:
            typer.echo(f"{driver:<11} host CPU")
            continue
        found = list_devices(driver)
        if not found:
            typer.echo(f"{driver:<11} (no device)")
        for d in found:
            kind = "CPU implementation" if d.is_cpu_emulation else d.kind.upper()
            typer.echo(f"{d.label:<11} {d.name}  [{kind}]")


@app.command("run")
def run_cmd(
    artifact_dir: Path = typer.Argument(..., help="artifact directory (holds manifest.json)"),
    prompt: str = typer.Option(..., "--prompt", "-p", help="what to draw"),
    negative_prompt: str = typer.Option("", "--negative-prompt", "-n", help="what to avoid"),
    steps: int = typer.Option(None, "--steps", help="denoising steps (default: per scheduler)"),
    guidance_scale: float = typer.Option(7.5, "--guidance-scale", "-g", help="CFG scale"),
    scheduler: str = typer.Option(None, "--scheduler", help="default: the model's own"),
    seed: int = typer.Option(None, "--seed", help="default: random, printed and stored"),
    num_images: int = typer.Option(1, "--num-images", help="images to make"),
    width: int = typer.Option(None, "--width", help="must equal the compiled width"),
    height: int = typer.Option(None, "--height", help="must equal the compiled height"),
    device: str = typer.Option(None, "--device", "-d", help="local-task, vulkan, vulkan:N, name"),
    output: Path = typer.Option(Path("sdiree.png"), "--output", "-o", help="PNG path"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace existing files"),
    force_device: bool = typer.Option(False, "--force-device", help="skip the arch check"),
) -> None:
    """Make an image from a prompt with a compiled artifact (torch-free)."""
    from .generate import generate_to_files

    try:
        generate_to_files(
            artifact_dir=artifact_dir,
            prompt=prompt,
            negative_prompt=negative_prompt,
            steps=steps,
            guidance_scale=guidance_scale,
            scheduler=scheduler,
            seed=seed,
            num_images=num_images,
            width=width,
            height=height,
            device=device,
            output=output,
            overwrite=overwrite,
            force_device=force_device,
        )
    except UserError as e:
        fail(str(e))


@app.command("bench")
def bench_cmd(
    model_dir: Path = typer.Argument(..., help="diffusers model folder (holds model_index.json)"),
    target: str = typer.Option(..., "--target", "-t", help="cpu, vulkan-spirv, rocm or cuda"),
    arch: str = typer.Option(None, "--arch", help="chip preset of the target (see specs/)"),
    dtype: str = typer.Option(
        None, "--dtype", help="fp32, fp16, or bf16 on cpu (default: per target)"
    ),
    height: int = typer.Option(None, "--height", help="image height (default: the model's)"),
    width: int = typer.Option(None, "--width", help="image width (default: the model's)"),
    steps: int = typer.Option(20, "--steps", help="denoising steps of the whole-image figure"),
    runs: int = typer.Option(5, "--runs", help="timed runs per figure"),
    warmup: int = typer.Option(2, "--warmup", help="untimed warm-up runs per figure"),
    json_path: Path = typer.Option(None, "--json", help="report (default: ARTIFACT/bench.json)"),
    torch_compile: bool = typer.Option(False, "--torch-compile", help="torch.compile the UNet"),
    torch_device: str = typer.Option(
        None, "--torch-device", help="torch's device: cpu or cuda (default: per target)"
    ),
    torch_dtype: str = typer.Option(
        None, "--torch-dtype", help="torch's dtype: fp32, fp16 or bf16 (default: the artifact's)"
    ),
    out: Path = typer.Option(None, "--out", "-o", help="artifact directory (compiled or reused)"),
    device: str = typer.Option(None, "--device", "-d", help="sdiree device (as for `run`)"),
    prompt: str = typer.Option(None, "--prompt", "-p", help="prompt of the whole-image figure"),
    seed: int = typer.Option(42, "--seed", help="seed of the inputs and of the image"),
    specs: Path = typer.Option(None, "--specs", help="another specs directory (tuning work)"),
) -> None:
    """Time sdiree against diffusers/torch on the same work: one row per figure (compile extra)."""
    try:
        from sdiree.compile.bench import DEFAULT_PROMPT, BenchOptions, run_bench
    except ImportError as e:
        fail(f"{COMPILE_EXTRA_HINT} ({e})")
    try:
        run_bench(
            BenchOptions(
                model_dir=model_dir,
                target=target,
                arch=arch,
                dtype=dtype,
                height=height,
                width=width,
                steps=steps,
                runs=runs,
                warmup=warmup,
                json_path=json_path,
                torch_compile=torch_compile,
                torch_device=torch_device,
                torch_dtype=torch_dtype,
                out=out,
                device=device,
                prompt=prompt or DEFAULT_PROMPT,
                seed=seed,
                specs_dir=specs,
            )
        )
    except UserError as e:
        fail(str(e))


def main() -> None:
    try:
        code = app(standalone_mode=False)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        # click/typer usage errors (missing or malformed options): one line, no panel.
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            print(f"error: {e.format_message()} (see `sdiree --help`)", file=sys.stderr)
            sys.exit(e.exit_code)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
