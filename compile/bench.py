"""`sdiree bench`: sdiree against diffusers/torch on the same work, model, device, dtype and shape.

Modelled on ONNX Runtime's Stable Diffusion benchmark (warm-up runs, then timed runs; peak
memory of the first and of a later run; one row per configuration), with one row per figure:

- ``text_encoder``: one call of each text encoder of the family's recipe (token embeddings,
  batch B; SDXL: both of its encoders, one after the other);
- ``unet``: one guided UNet call at batch 2B (sdiree's ``denoise_cfg``, both halves from B
  latents; diffusers' UNet on the latents repeated, as its pipelines call it), on the inputs the
  artifact's UNet declares (SDXL: its added ``text_embeds`` and ``time_ids`` too);
- ``vae_decode``: one VAE decode (latents → image, scaling factor included on both sides; torch's
  VAE in float32 where the family's pipeline upcasts it, SDXL's fp16 ``force_upcast``);
- ``image``: a whole image at S steps (tokenize, encode prompt and negative prompt, S guided
  UNet steps with the model's scheduler, decode, 8-bit pixels), sdiree's ``Text2Image`` against
  the family's diffusers pipeline (specs/families.json ``pipeline_classes``: SD 1.x/2.x's
  ``StableDiffusionPipeline``, SDXL's ``StableDiffusionXLPipeline``) with the same prompt, seed
  and scheduler.

What differs by family is read from the artifact's manifest and the family registry
(``bench_family``), never from the family's name. This module drives the bench; its parts are
``bench_sides`` (the sdiree and torch sides), ``bench_worker`` (the worker processes and their
protocol), ``bench_memory`` (RSS and peak RSS) and ``bench_report`` (statistics, parity, markdown).

Method:

- The artifact is compiled (or reused) through ``compile_model``; its Reporter gives the seconds
  per submodule (the VAE's load and shared parameter archive are counted under vae_decoder).
- Each side runs in its own fresh worker process (``python -m sdiree.compile.bench_worker``):
  the sdiree worker imports only the torch-free runtime (checked: torch is not in its
  ``sys.modules``), the torch worker imports torch and diffusers. Neither sees the other's
  memory, and the parent (which compiled) holds no model while timing.
- The parent drives the two workers in turn, one call at a time, alternating for every run
  (sdiree run i, torch run i, sdiree run i+1, ...), so drift in machine load hits both sides; a
  worker waits idle on its pipe while the other runs. A run is ``back_to_back`` calls in a row
  (``--back-to-back``, 2), the last one timed: a denoising loop's steady state, where an
  engine's calls follow each other; the first absorbs the idle wait (threads asleep) and any
  spinning of the other side's threads, which ran into a lone call (sdiree's bf16 UNet call on
  a 2-core Xeon: 1.47 s right after OpenVINO's, 1.21 s as the second of two; compile/NOTES.md).
  Sides are SETTLE_S apart. Both stay loaded the whole time, so a
  model whose sides do not fit in memory together (SDXL in fp32 on a 24 GiB machine: ~14 GB of
  torch weights beside sdiree's) would be timed while the kernel evicts one side's mapped
  weights; ``in_turn`` (``--in-turn``) instead runs one side's worker through every figure,
  closes it, then starts the next (no alternation: a quiet machine matters more). Each side's
  ``worker_s`` (start, end) on the parent's clock shows which way it ran. Each figure gets W
  warm-up runs and then N timed runs; median, min and max are over the N timed runs. The image figure runs first, so
  its first run is each process's first inference after loading.
- Every call converts its inputs from numpy and its outputs back to numpy on the host, on both
  sides (sdiree's Session.call contract; torch: ``from_numpy(...).to(device)`` ... ``.cpu()``),
  so GPU timings include synchronisation.
- Memory: process RSS (anonymous and file-backed resident pages: IREE memory-maps parameter
  archives, torch copies weights into anonymous memory; both count once touched). Before each
  call the worker resets the kernel's peak-RSS mark (``/proc/self/clear_refs`` ← 5) and reads
  ``VmHWM`` after it, giving the true peak of that call alone; where that is unavailable a
  psutil sampling thread (1 ms) stands in (``memory_method`` in the JSON). Reported: RSS after
  imports, the peak while loading, RSS after loading, and per figure the peak of its first run
  and of its last run. On GPU targets the torch side also reports ``device_peak_mb``
  (torch.cuda.max_memory_allocated, reset before each run) and, on GPU drivers, sdiree the HAL
  allocator's device-local high-water mark (not resettable: the peak up to that run).
- Parity: the outputs of each side's last run of each figure on the same inputs (drawn once by
  ``verify.make_inputs`` and shared through a file) are compared: max abs difference, the
  output's scale and their ratio; for the image, max abs difference in 8-bit levels and PSNR.
- torch side: eager mode with SDPA attention (AttnProcessor2_0, ``sdpa`` for the text
  encoders), in the artifact's dtype (or ``torch_dtype``), on the artifact's device (cpu → cpu;
  cuda and rocm → torch's cuda device; vulkan-spirv → cpu, as torch has no Vulkan backend,
  unless ``torch_device`` names cuda: what a user of an NVIDIA GPU would otherwise run);
  ``torch_compile`` wraps the UNet with ``torch.compile`` (its compile lands in the first run).
- Peers (``peers``, optional: the ``peers`` extra): OpenVINO and ONNX Runtime on the CPU, each
  one more side in its own worker, alternated with the two above on the same inputs (the image
  figure: sdiree's numpy pipeline with the peer's models); their models are exported once per
  model and shape (``compile/peers/``). Each gets the same timing, memory and parity (against
  torch) as sdiree, and its time over sdiree's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _require_compile_extra() -> None:
    """Raise ImportError when the compile extra is missing (without importing anything)."""
    for name in ("torch", "diffusers", "transformers", "iree.compiler"):
        if importlib.util.find_spec(name) is None:
            raise ImportError(f"No module named '{name}'")


_require_compile_extra()

# The parts, re-exported here as `sdiree bench`'s API (the tests and peers import them from here).
from .bench_family import bench_calls, bench_inputs, family_spec, figure_outputs  # noqa: E402
from .bench_report import (  # noqa: E402
    _environment,
    _figure_labels,
    _finite,
    _loadavg,
    _parity_cell,
    _side_stats,
    compile_times,
    markdown,
    parity,
)
from .bench_sides import FIGURES, SIDES, device_peak_mb, image_request  # noqa: E402
from .bench_worker import Worker, _die_with_parent, worker_main  # noqa: E402

__all__ = [
    "FIGURES",
    "SIDES",
    "BenchOptions",
    "Worker",
    "_die_with_parent",
    "_finite",
    "_parity_cell",
    "compile_times",
    "device_peak_mb",
    "image_request",
    "markdown",
    "parity",
    "run_bench",
]

SCHEMA = "sdiree-bench/1"
RUN_ORDER = ("image", "text_encoder", "unet", "vae_decode")  # image first: first inference
# pause between two sides' calls: a side's worker threads spin on after its call (OpenVINO's did
# into sdiree's next call: 1.47 s against 1.28 after a 1 s pause, compile/NOTES.md)
SETTLE_S = 0.25
TORCH_DEVICE = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda", "vulkan-spirv": "cpu"}
TORCH_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DEFAULT_PROMPT = "a photograph of an astronaut riding a horse"


@dataclass
class BenchOptions:
    model_dir: Path
    target: str
    arch: str | None = None
    dtype: str | None = None
    height: int | None = None
    width: int | None = None
    steps: int = 20
    runs: int = 5
    warmup: int = 2
    json_path: Path | None = None
    torch_compile: bool = False
    torch_device: str | None = None  # None: TORCH_DEVICE of the target
    torch_dtype: str | None = None  # None: the artifact's dtype
    out: Path | None = None
    device: str | None = None
    prompt: str = DEFAULT_PROMPT
    negative_prompt: str = ""
    guidance_scale: float = 7.5
    seed: int = 42
    specs_dir: Path | None = None
    peers: str | None = None  # e.g. "openvino,onnxruntime" (compile/peers/__init__.py)
    in_turn: bool = False  # one side's worker at a time (models whose sides do not fit together)
    # calls a run makes back to back, the last one timed: the steady state of a denoising loop,
    # where an engine's calls follow each other, past the idle wait of the alternation
    back_to_back: int = 2


# -- the parent: compile, drive the workers, report -----------------------------------------------


def _validate(opts: BenchOptions) -> None:
    from sdiree.runtime.errors import UserError

    if opts.runs < 1:
        raise UserError(f"--runs {opts.runs}: at least one timed run is needed")
    if opts.warmup < 0:
        raise UserError(f"--warmup {opts.warmup} must be 0 or more")
    if opts.back_to_back < 1:
        raise UserError(f"--back-to-back {opts.back_to_back}: at least one call a run is needed")
    if opts.steps < 1:
        raise UserError(f"--steps {opts.steps}: the number of steps must be at least 1")
    if opts.target not in TORCH_DEVICE:
        raise UserError(f"unknown target '{opts.target}': choose one of {', '.join(TORCH_DEVICE)}")
    if opts.torch_dtype not in (None, *TORCH_DTYPE):
        raise UserError(f"--torch-dtype {opts.torch_dtype}: choose {', '.join(TORCH_DTYPE)}")
    torch_devices = sorted(set(TORCH_DEVICE.values()))
    if opts.torch_device not in (None, *torch_devices):
        raise UserError(f"--torch-device {opts.torch_device}: choose {' or '.join(torch_devices)}")
    if opts.json_path is not None:
        _check_json_path(Path(opts.json_path))
    _peer_names(opts)


def _peer_names(opts: BenchOptions) -> list[str]:
    """The peers asked for, checked to be known and installed (one line saying how if not)."""
    if not opts.peers:
        return []
    from .peers import check_installed, parse_peers

    text = opts.peers if isinstance(opts.peers, str) else ",".join(opts.peers)
    names = parse_peers(text)
    check_installed(names)
    return names


def _check_json_path(path: Path) -> None:
    """Refuse a --json path that cannot be written, before minutes of compiling and timing.

    The report is written to a temp file beside it and renamed, so what matters is that its
    directory (or the nearest existing one above it, where the rest will be created) takes a
    new file: tried by creating and removing one, which also catches read-only file systems.
    """
    from sdiree.runtime.errors import UserError

    if path.is_dir():
        raise UserError(f"--json {path} is a directory; name a file")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--json {path}: {existing} is not a directory; choose another path")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".sdiree-bench-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(
            f"--json {path}: cannot write in {existing} ({e.strerror or e}); choose another path"
        ) from None


def run_bench(opts: BenchOptions, out=None, log=None) -> dict:
    """Compile (or reuse), time both sides, write the JSON, print the markdown; returns the report."""
    from sdiree.runtime import schedulers
    from sdiree.runtime.fileutil import atomic_write_bytes
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.pipeline import scheduler_config

    from .driver import CompileOptions, compile_model
    from .report import Reporter

    out = out or sys.stdout
    log = log or sys.stderr
    _validate(opts)
    peers = _peer_names(opts)
    sides = (*SIDES, *peers)
    load_start = _loadavg()
    reporter = Reporter(stream=log)
    manifest_path = compile_model(
        CompileOptions(
            model_dir=Path(opts.model_dir),
            target=opts.target,
            arch=opts.arch,
            dtype=opts.dtype,
            height=opts.height,
            width=opts.width,
            out=opts.out,
            specs_dir=opts.specs_dir,
        ),
        reporter,
    )
    art = manifest_path.parent
    manifest = load_manifest(art)
    compiled = compile_times(reporter, tuple(manifest.submodules))
    img = manifest.image
    config = scheduler_config(manifest)
    sched = schedulers.name_for_config(config)
    diffusers_sched = None
    if sched is None:  # no sdiree port of the model's scheduler: both sides use Euler
        sched, diffusers_sched = "euler", "EulerDiscreteScheduler"

    calls = bench_calls(manifest)
    work = Path(tempfile.mkdtemp(prefix="sdiree-bench-"))
    np.savez(work / "inputs.npz", **bench_inputs(manifest, calls, opts.seed))
    torch_dtype = TORCH_DTYPE[opts.torch_dtype or manifest.dtype]
    spec = {
        "artifact_dir": str(art),
        "model_dir": str(Path(opts.model_dir).absolute()),
        "device": opts.device,
        "torch_device": opts.torch_device or TORCH_DEVICE[manifest.target],
        "torch_dtype": torch_dtype,
        "torch_compile": opts.torch_compile,
        "inputs": str(work / "inputs.npz"),
        "prompt": opts.prompt,
        "negative_prompt": opts.negative_prompt,
        "guidance_scale": opts.guidance_scale,
        "seed": opts.seed,
        "steps": opts.steps,
        "scheduler": sched,
        "diffusers_scheduler": diffusers_sched,
        "height": img["height"],
        "width": img["width"],
        "latent_shape": [1, img["latent_channels"], img["latent_height"], img["latent_width"]],
        **family_spec(manifest),
    }
    if peers:
        from .peers import needs_openvino
        from .peers.export import ensure_models

        formats = ["onnx", "openvino"] if needs_openvino(peers) else ["onnx"]
        spec["peer_models"] = str(
            ensure_models(manifest, Path(opts.model_dir), work / "inputs.npz", formats, work, log)
        )
    (work / "spec.json").write_text(json.dumps(spec, indent=2))
    output_names = figure_outputs(manifest)

    def say(msg: str) -> None:
        print(msg, file=log, flush=True)

    total = opts.warmup + opts.runs
    workers: dict[str, Worker] = {}
    runs: dict[str, dict[str, list[dict]]] = {f: {s: [] for s in sides} for f in FIGURES}
    loads: dict[str, dict] = {}
    clock0 = time.monotonic()

    def start(group: tuple[str, ...]) -> None:
        for side in group:
            workers[side] = Worker(side, work / "spec.json", work / f"{side}.log")
            loads[side] = {"worker_s": [time.monotonic() - clock0, None]}
        for side in group:
            say(f"[bench load {side}] ...")
            loads[side].update(workers[side].ask(op="import"))
            loads[side].update(workers[side].ask(op="load"))
            say(f"[bench load {side}] done in {loads[side]['seconds']:.1f}s")

    def time_figures(group: tuple[str, ...]) -> None:
        for figure in RUN_ORDER:
            for i in range(total):
                line = []
                for side in group:
                    save = str(work / f"{side}-{figure}.npz") if i == total - 1 else None
                    r = workers[side].ask(
                        op="run", figure=figure, save=save, repeat=opts.back_to_back
                    )
                    r["warmup"] = i < opts.warmup
                    runs[figure][side].append(r)
                    line.append(f"{side} {r['seconds']:.3f}s")
                    time.sleep(SETTLE_S)
                kind = "warm-up" if i < opts.warmup else "run"
                say(f"[bench {figure}] {kind} {i + 1}/{total}: " + ", ".join(line))

    def close(group: tuple[str, ...]) -> None:
        for side in group:
            workers.pop(side).close()
            loads[side]["worker_s"][1] = time.monotonic() - clock0

    try:
        for group in [(side,) for side in sides] if opts.in_turn else [sides]:
            start(group)
            time_figures(group)
            close(group)
    except BaseException:
        for w in workers.values():
            w.close(kill=True)
        say(f"bench: worker logs kept in {work}")
        raise

    labels = _figure_labels(manifest, opts.steps, sched)
    figures = {}
    for figure in FIGURES:
        entry = {"label": labels[figure]}
        for side in SIDES:
            entry[side] = _side_stats(runs[figure][side])
        entry["ratio"] = entry["sdiree"]["median_s"] / entry["torch"]["median_s"]
        entry["parity"] = parity(
            figure,
            output_names[figure],
            work / f"sdiree-{figure}.npz",
            work / f"torch-{figure}.npz",
        )
        if peers:
            entry["peers"] = {}
        for peer in peers:
            e = _side_stats(runs[figure][peer])
            e["vs_sdiree"] = e["median_s"] / entry["sdiree"]["median_s"]
            e["vs_torch"] = e["median_s"] / entry["torch"]["median_s"]
            e["parity"] = parity(
                figure,
                output_names[figure],
                work / f"{peer}-{figure}.npz",
                work / f"torch-{figure}.npz",
                side=peer,
            )
            entry["peers"][peer] = e
        figures[figure] = entry
    shutil.rmtree(work, ignore_errors=True)

    report = {
        "schema": SCHEMA,
        "config": {
            "model": Path(opts.model_dir).absolute().name,
            "model_dir": str(Path(opts.model_dir).absolute()),
            "artifact_dir": str(art),
            "target": manifest.target,
            "arch": manifest.arch,
            "dtype": manifest.dtype,
            "height": img["height"],
            "width": img["width"],
            "batch_size": img["batch_size"],
            "steps": opts.steps,
            "guidance_scale": opts.guidance_scale,
            "scheduler": sched,
            "prompt": opts.prompt,
            "negative_prompt": opts.negative_prompt,
            "seed": opts.seed,
            "runs": opts.runs,
            "warmup": opts.warmup,
            "back_to_back": opts.back_to_back,
            "torch_compile": opts.torch_compile,
            "torch_device": spec["torch_device"],
            "torch_dtype": torch_dtype,
            "peers": peers,
            "specs_dir": str(opts.specs_dir) if opts.specs_dir else None,
            "unet_flags": manifest.data["submodules"]["unet"].get("flags"),
            "unet_tuning_specs": manifest.data["submodules"]["unet"].get("tuning_specs"),
        },
        "environment": {**_environment(), "loadavg_start": load_start, "loadavg_end": _loadavg()},
        "method": {
            "alternation": (
                "in turn: each side's fresh worker runs every figure, then closes, before the "
                "next side's starts (--in-turn)"
                if opts.in_turn
                else "sdiree run i, torch run i, ... in two fresh worker processes"
            ),
            "timed": "median/min/max over the timed runs, after the warm-up runs; a run is "
            f"{opts.back_to_back} call(s) back to back, the last one timed, "
            f"{SETTLE_S} s after the other side's",
            "memory": "peak process RSS over each call (VmHWM after a reset), per side process",
            "memory_method": loads["sdiree"]["memory_method"],
            "parity": "last run's outputs of both sides on the same inputs",
            "ratio": "sdiree median / torch median (< 1: sdiree faster)",
            **(
                {
                    "peers": "one more worker each, alternated after torch; models exported from "
                    "the same diffusers modules (fp32, ONNX opset 17; OpenVINO IR from that "
                    "ONNX); parity against torch; vs_sdiree: peer median / sdiree median",
                    "peer_models": spec["peer_models"],
                }
                if peers
                else {}
            ),
        },
        "compile": compiled,
        "sides": {side: loads[side] for side in SIDES},
        "peers": {peer: loads[peer] for peer in peers},
        "figures": figures,
    }
    report = _finite(report)
    json_path = Path(opts.json_path) if opts.json_path else art / "bench.json"
    text = json.dumps(report, indent=2, allow_nan=False) + "\n"
    report["json_path"] = str(json_path)
    print(markdown(report), file=out, flush=True)  # first: a failed write below loses nothing
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(json_path, text.encode())
    except OSError as e:
        from sdiree.runtime.errors import UserError

        raise UserError(
            f"cannot write {json_path} ({e.strerror or e}); the results are in the table above"
        ) from None
    say(f"wrote {json_path}")
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "--worker":  # what the worker module's main serves
        return worker_main(argv[1], Path(argv[2]))
    print("usage: python -m sdiree.compile.bench --worker SIDE SPEC (use `sdiree bench`)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
