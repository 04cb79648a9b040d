"""Precompute at compile time what a module would otherwise compute from its weights at load.

With data tiling (and the cpu Winograd export) every weight is repacked, and the 3x3 ones
transformed, by the module's initializer: for SD 1.5's UNet on cpu that is ~20 s and ~15 GB of
peak memory on every load. iree-compile can split that work into a separate *encoder* module
(`--iree-parameter-encoder-output-file`); running the encoder once writes the results to a
parameter archive, and the main module then loads them instead of computing them.

The encoder writes one packed copy of a weight per matmul size that uses it (the UNet's batch 2
and batch 1), byte-identical, so the artifact keeps its output paged: each distinct page once
(sdiree.runtime.weights.pages).

Running an encoder is the runtime's job too (sdiree.runtime.weights.encoder): an artifact keeps
its encoders so that other weights (`sdiree run --weights/--lora`) are encoded without a
recompile.
"""

from __future__ import annotations

from pathlib import Path

from sdiree.runtime.fileutil import temp_path_for
from sdiree.runtime.session import parameter_providers
from sdiree.runtime.weights.encoder import driver_device, input_providers
from sdiree.runtime.weights.encoder import run_encoder as _run_encoder
from sdiree.runtime.weights.pages import store_encoded


def encoder_flags(encoder_mlir: Path, scope: str) -> list[str]:
    """Flags that make iree-compile write the encoder module and load encoded parameters
    from scope (overlay mode: the original archive still supplies everything else)."""
    return [
        f"--iree-parameter-encoder-output-file={encoder_mlir}",
        f"--iree-parameter-encoder-output-scope={scope}",
        "--iree-parameter-encoder-mode=overlay",
    ]


def run_encoder(
    encoder_vmfb: Path, inputs: list[tuple[str, Path]], scope: str, out: Path, driver: str
) -> int:
    """run_encoder (sdiree.runtime.weights.encoder) over input archives [(scope, path)] on the
    process's device of driver (the one the load probes and layout learning use), its output
    kept at out as a paged archive (each distinct page once:
    the packed copies of a weight for different matmul sizes are byte-identical). The inputs
    are mapped (input_providers); where the driver can (file_io) the output is written through
    a file handle, never mapped: a writable mapping of SD 1.5's UNet output held ~10 GiB of
    dirty pages."""
    device = driver_device(driver)
    raw = temp_path_for(out.with_name(f"{out.stem}.raw{out.suffix}"))
    try:
        with input_providers(inputs) as sources:
            count = _run_encoder(encoder_vmfb, sources, scope, raw, device)
            del sources
        if count:
            store_encoded(raw, out)
    finally:
        raw.unlink(missing_ok=True)
    return count


PROBE_LOADS, PROBE_MISSING = 0, 10  # a probe child's exit codes (anything else: it failed)
PROBE_TRIES = 3
PROBE_TIMEOUT_S = 300  # a load takes well under a second; a hung driver must not hang compile


def loads_with(vmfb: Path, archives: list[tuple[str, Path]], driver: str) -> bool:
    """Whether vmfb finds every parameter it needs in archives [(scope, path)]: its
    initializers run here, so with encoded weights this is a cheap load.

    On a GPU driver each probe runs in a child process that exits without tearing anything
    down: after a context failed half-way through its initializer, lavapipe segfaulted about
    one time in ten when that device was destroyed, and a device kept for the next probe
    instead sometimes failed it with "transient buffer has no staged Vulkan backing"
    (compile/NOTES.md). A child that dies of a signal is tried again; one that fails otherwise
    raises RuntimeError with its last line. CPU drivers probe in this process."""
    from sdiree.runtime.device import CPU_DRIVERS

    if driver in CPU_DRIVERS:
        return _loads_here(vmfb, archives, driver)
    import json
    import subprocess
    import sys

    from .iree_compile import _die_with_parent

    request = json.dumps({"vmfb": str(vmfb), "archives": [[s, str(p)] for s, p in archives],
                          "driver": driver})  # fmt: skip
    code = "from sdiree.compile.param_encoder import _probe_main; _probe_main()"
    for _ in range(PROBE_TRIES):
        try:
            proc = subprocess.run([sys.executable, "-c", code, request], capture_output=True,
                                  text=True, preexec_fn=_die_with_parent(),
                                  timeout=PROBE_TIMEOUT_S)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"loading {vmfb.name} on {driver} did not finish in {PROBE_TIMEOUT_S} s"
            ) from None
        if proc.returncode in (PROBE_LOADS, PROBE_MISSING):
            return proc.returncode == PROBE_LOADS
        if proc.returncode > 0:
            break
    lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
    raise RuntimeError(f"loading {vmfb.name} on {driver} failed: {lines[-1]}")


def _probe_main() -> None:
    """A probe child: loads_with on the request in argv[1], answered by the exit code. It
    leaves with os._exit, so no device or context is destroyed (the crash above)."""
    import json
    import os
    import sys

    req = json.loads(sys.argv[1])
    archives = [(s, Path(p)) for s, p in req["archives"]]
    try:
        loaded = _loads_here(Path(req["vmfb"]), archives, req["driver"])
    except Exception as e:  # noqa: BLE001 - reported to the parent through stderr
        print(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    os._exit(PROBE_LOADS if loaded else PROBE_MISSING)


def _loads_here(vmfb: Path, archives: list[tuple[str, Path]], driver: str) -> bool:
    import iree.runtime as rt

    instance = rt.VmInstance()
    device = driver_device(driver)
    providers = parameter_providers(archives)
    # Held in names: a module freed while VmContext raises turns the error into a SystemError.
    params = rt.create_io_parameters_module(instance, *providers)
    hal = rt.create_hal_module(instance, device)
    module = rt.VmModule.mmap(instance, str(vmfb))
    try:
        rt.VmContext(instance, modules=[params, hal, module])
    except ValueError as e:
        if "no parameter found" in str(e) or "no provider registered" in str(e):
            return False
        raise
    return True
