"""`sdiree bench`: sdiree against diffusers/torch on the same work, model, device, dtype and shape.

Modelled on ONNX Runtime's Stable Diffusion benchmark (warm-up runs, then timed runs; peak
memory of the first and of a later run; one row per configuration), with one row per figure:

- ``text_encoder``: one text encoder call (token ids, batch B);
- ``unet``: one guided UNet call at batch 2B (sdiree's ``denoise_cfg``, both halves from B
  latents; diffusers' UNet on the latents repeated, as its pipelines call it);
- ``vae_decode``: one VAE decode (latents → image, scaling factor included on both sides);
- ``image``: a whole image at S steps (tokenize, encode prompt and negative prompt, S guided
  UNet steps with the model's scheduler, decode, 8-bit pixels), sdiree's ``Text2Image`` against
  diffusers' ``StableDiffusionPipeline`` with the same prompt, seed and scheduler.

Method:

- The artifact is compiled (or reused) through ``compile_model``; its Reporter gives the seconds
  per submodule (the VAE's load and shared parameter archive are counted under vae_decoder).
- Each side runs in its own fresh worker process (``python -m sdiree.compile.bench --worker``):
  the sdiree worker imports only the torch-free runtime (checked: torch is not in its
  ``sys.modules``), the torch worker imports torch and diffusers. Neither sees the other's
  memory, and the parent (which compiled) holds no model while timing.
- The parent drives the two workers in turn, one call at a time, alternating for every run
  (sdiree run i, torch run i, sdiree run i+1, ...), so drift in machine load hits both sides; a
  worker waits idle on its pipe while the other runs. Each figure gets W warm-up runs and then
  N timed runs; median, min and max are over the N timed runs. The image figure runs first, so
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
  encoder), in the artifact's dtype (or ``torch_dtype``), on the artifact's device (cpu → cpu;
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

import gc
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _require_compile_extra() -> None:
    """Raise ImportError when the compile extra is missing (without importing anything)."""
    for name in ("torch", "diffusers", "transformers", "iree.compiler"):
        if importlib.util.find_spec(name) is None:
            raise ImportError(f"No module named '{name}'")


_require_compile_extra()

SCHEMA = "sdiree-bench/1"
FIGURES = ("text_encoder", "unet", "vae_decode", "image")  # display order
RUN_ORDER = ("image", "text_encoder", "unet", "vae_decode")  # image first: first inference
SIDES = ("sdiree", "torch")
SETTLE_S = 0.05  # pause between calls, so one side's spinning threads never overlap the other
TORCH_DEVICE = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda", "vulkan-spirv": "cpu"}
TORCH_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DEFAULT_PROMPT = "a photograph of an astronaut riding a horse"
SUBMODULE_OF_ITEM = {"vae": "vae_decoder"}  # the VAE's load and shared archive


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


# -- memory -----------------------------------------------------------------------------------


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def rss_mb() -> float:
    v = _status_mb("VmRSS")
    if v is not None:
        return v
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_mb("VmHWM") is not None


class PeakRSS:
    """Peak RSS (MB) over a with-block: VmHWM after a reset, or a psutil sampling thread."""

    def __init__(self) -> None:
        self.method = "vmhwm-reset" if _can_reset_peak() else "psutil-sampling-1ms"
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        if self.method == "vmhwm-reset":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self.peak_mb = rss_mb()
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak_mb = max(self.peak_mb, rss_mb())

    def __exit__(self, *exc) -> None:
        if self.method == "vmhwm-reset":
            self.peak_mb = _status_mb("VmHWM") or 0.0
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, rss_mb())


# -- the two sides, each in its own worker process ----------------------------------------------


def image_request(manifest, spec: dict):
    """The whole-image figure's request, the same for every side that runs sdiree's pipeline."""
    from sdiree.runtime.pipeline import GenerationRequest, resolve_request

    return resolve_request(
        manifest,
        GenerationRequest(
            prompt=spec["prompt"],
            negative_prompt=spec["negative_prompt"],
            steps=spec["steps"],
            guidance_scale=spec["guidance_scale"],
            scheduler=spec["scheduler"],
            seed=spec["seed"],
        ),
    )


class SdireeSide:
    """sdiree's runtime: Session calls and Text2Image, torch-free."""

    @staticmethod
    def imports() -> None:
        import iree.runtime  # noqa: F401

        import sdiree.runtime.pipeline  # noqa: F401
        import sdiree.runtime.session  # noqa: F401

    def __init__(self, spec: dict):
        from sdiree.runtime.device_select import choose_device
        from sdiree.runtime.image_output import to_uint8
        from sdiree.runtime.manifest import load_manifest
        from sdiree.runtime.pipeline import Text2Image
        from sdiree.runtime.session import Session

        manifest = load_manifest(Path(spec["artifact_dir"]))
        info, _ = choose_device(manifest, spec["device"])
        self.session = Session(manifest, info, Text2Image.SUBMODULES)
        t2i = Text2Image(manifest, self.session)
        req = image_request(manifest, spec)
        x = dict(np.load(spec["inputs"]))
        call = self.session.call
        te = [
            x[f"text_encoder.{t.name}"] for t in self.session.decl("text_encoder", "encode").inputs
        ]
        self.figures = {
            "text_encoder": lambda: call("text_encoder", "encode", *te),
            "unet": lambda: call(
                "unet",
                "denoise_cfg",
                x["unet.sample"],
                x["unet.timestep"],
                x["unet.encoder_hidden_states"],
            ),
            "vae_decode": lambda: call("vae_decoder", "decode", x["vae_decode.latents"]),
            "image": lambda: [to_uint8(t2i.generate(req, progress=None).images)],
        }
        self.info = {"device": f"{info.label} ({info.name})", "scheduler": req.scheduler}

    def after_run(self) -> dict:
        from sdiree.runtime.device import CPU_DRIVERS

        if self.session.device_info.driver in CPU_DRIVERS:
            return {}  # the host's memory: in RSS already
        peak = device_peak_mb(self.session.device)
        return {} if peak is None else {"device_peak_mb": peak}


def device_peak_mb(device) -> float | None:
    """The HAL allocator's device-local high-water mark since the device was opened, in MiB
    (IREE keeps no resettable peak, unlike torch.cuda); None where it keeps no statistics."""
    allocator = device.allocator
    if not allocator.has_statistics:
        return None
    return allocator.statistics["device_bytes_peak"] / 2**20


class TorchSide:
    """diffusers' StableDiffusionPipeline and its torch modules, eager with SDPA attention."""

    @staticmethod
    def imports() -> None:
        from .quiet import quiet_libraries

        quiet_libraries()
        import diffusers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401

    def __init__(self, spec: dict):
        import diffusers
        import torch
        from diffusers.models.attention_processor import AttnProcessor2_0

        from .exporters.text_encoder import TextEncoderEntry
        from .exporters.unet import UNetEntry

        self.torch = torch
        dtype = getattr(torch, spec["torch_dtype"])
        device = torch.device(spec["torch_device"])
        self.cuda = device.type == "cuda"
        pipe = diffusers.StableDiffusionPipeline.from_pretrained(
            spec["model_dir"],
            torch_dtype=dtype,
            safety_checker=None,
            requires_safety_checker=False,
            local_files_only=True,
        )
        pipe.set_progress_bar_config(disable=True)
        if spec["diffusers_scheduler"]:
            cls = getattr(diffusers, spec["diffusers_scheduler"])
            pipe.scheduler = cls.from_config(pipe.scheduler.config)
        pipe.unet.set_attn_processor(AttnProcessor2_0())
        pipe.vae.set_attn_processor(AttnProcessor2_0())
        pipe.text_encoder.set_attn_implementation("sdpa")
        pipe.to(device)
        if spec["torch_compile"]:
            pipe.unet = torch.compile(pipe.unet)
        sf = pipe.vae.config.scaling_factor
        x = dict(np.load(spec["inputs"]))

        def t(name):  # float inputs in torch's dtype (it may differ from the artifact's)
            a = torch.from_numpy(x[name]).to(device)
            return a.to(dtype) if a.is_floating_point() else a

        def host(o):
            o = o.detach().cpu()
            return (o.float() if o.dtype == torch.bfloat16 else o).numpy()

        te_call = TextEncoderEntry(pipe.text_encoder)  # on the token embeddings, as exported

        def text_encoder():
            hidden, pooled = te_call(t("text_encoder.inputs_embeds"), t("text_encoder.eos_index"))
            return [host(hidden), host(pooled)]

        unet_call = UNetEntry(pipe.unet)  # repeats the latents for both halves, as pipelines do

        def unet():
            args = (t("unet.sample"), t("unet.timestep"), t("unet.encoder_hidden_states"))
            return [host(unet_call(*args))]

        def vae_decode():
            return [host(pipe.vae.decode(t("vae_decode.latents") / sf, return_dict=False)[0])]

        def image():
            # The starting noise drawn as sdiree draws it (float32 from a CPU generator, then cast):
            # diffusers draws it in the pipeline's dtype, which for fp16 is other noise.
            g = torch.Generator("cpu").manual_seed(spec["seed"])
            latents = torch.randn(spec["latent_shape"], generator=g).to(device, dtype)
            out = pipe(
                spec["prompt"],
                latents=latents,
                negative_prompt=spec["negative_prompt"] or None,
                num_inference_steps=spec["steps"],
                guidance_scale=spec["guidance_scale"],
                generator=torch.Generator("cpu").manual_seed(spec["seed"]),
                height=spec["height"],
                width=spec["width"],
                output_type="np",
            ).images
            return [(out * 255).round().astype(np.uint8)]

        def no_grad(fn):
            def run():
                with torch.inference_mode():
                    return fn()

            return run

        self.figures = {
            name: no_grad(fn)
            for name, fn in (
                ("text_encoder", text_encoder),
                ("unet", unet),
                ("vae_decode", vae_decode),
                ("image", image),
            )
        }
        self.info = {
            "device": str(device),
            "dtype": spec["torch_dtype"],
            "threads": torch.get_num_threads(),
            "attention": "sdpa",
            "torch_compile": bool(spec["torch_compile"]),
            "scheduler": type(pipe.scheduler).__name__,
        }
        if self.cuda:
            self.info["device_name"] = torch.cuda.get_device_name(device)

    def before_run(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def after_run(self) -> dict:
        if self.cuda:
            return {"device_peak_mb": self.torch.cuda.max_memory_allocated() / 2**20}
        return {}


def _die_with_parent() -> None:
    """Linux: have the kernel kill this worker when the parent bench process dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _side_class(side: str):
    if side in SIDES:
        return SdireeSide if side == "sdiree" else TorchSide
    from .peers import side_class

    return side_class(side)


def worker_main(side: str, spec_path: Path) -> int:
    """Serve one side: JSON requests on stdin, one JSON reply a line on the original stdout."""
    _die_with_parent()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (by us or a library, Python or C) goes to the log
    spec = json.loads(Path(spec_path).read_text())
    cls = _side_class(side)
    runner = None
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "quit":
            break
        try:
            if op == "import":
                rss0 = rss_mb()
                t0 = time.perf_counter()
                cls.imports()
                reply = {
                    "import_s": time.perf_counter() - t0,
                    "rss_at_start_mb": rss0,
                    "rss_after_imports_mb": rss_mb(),
                }
            elif op == "load":
                reply = {}
                with PeakRSS() as peak:
                    t0 = time.perf_counter()
                    runner = cls(spec)
                    reply["seconds"] = time.perf_counter() - t0
                gc.collect()
                reply.update(
                    peak_rss_load_mb=peak.peak_mb,
                    rss_after_load_mb=rss_mb(),
                    memory_method=peak.method,
                    torch_imported="torch" in sys.modules,
                    pid=os.getpid(),
                    **runner.info,
                )
            elif op == "run":
                fn = runner.figures[msg["figure"]]
                gc.collect()
                if hasattr(runner, "before_run"):
                    runner.before_run()
                rss0 = rss_mb()
                with PeakRSS() as peak:
                    t0 = time.perf_counter()
                    outs = fn()
                    seconds = time.perf_counter() - t0
                reply = {
                    "seconds": seconds,
                    "peak_rss_mb": peak.peak_mb,
                    "rss_before_mb": rss0,
                    **runner.after_run(),
                }
                if msg.get("save"):
                    np.savez(msg["save"], *outs)
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the parent, traceback to the log
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")
    return 0


class Worker:
    """The parent's handle on one side's worker process."""

    def __init__(self, side: str, spec_path: Path, log_path: Path):
        self.side = side
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sdiree.compile.bench", "--worker", side, str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            env=env,
        )

    def ask(self, **msg) -> dict:
        from sdiree.runtime.errors import UserError

        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.wait(timeout=30)
            raise UserError(
                f"the {self.side} bench worker died (exit {self.proc.returncode}) during "
                f"{msg.get('op')} {msg.get('figure', '')}: {self._log_tail()} (log: {self.log_path})"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise UserError(
                f"the {self.side} side failed during {msg.get('op')} {msg.get('figure', '')}: "
                f"{reply['error']} (log: {self.log_path})"
            )
        return reply

    def _log_tail(self) -> str:
        self._log.flush()
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip() if lines else "no output"

    def close(self, kill: bool = False) -> None:
        if kill and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- the parent: compile, drive the workers, report -----------------------------------------------


def compile_times(reporter) -> dict:
    """Seconds per submodule from the compile Reporter; 'reused' when nothing was redone."""
    from .driver import SUBMODULES

    subs = {s: {"status": "reused", "seconds": 0.0, "stages": {}} for s in SUBMODULES}
    shared = {}
    for r in reporter.records:
        base = r.item.split(".")[0]  # "unet.winograd2": the UNet's derived-weights archive
        sub = SUBMODULE_OF_ITEM.get(base, base)
        entry = subs.get(sub)
        if entry is None:
            if r.status == "done":
                shared[f"{r.stage}:{r.item}"] = round(r.seconds, 3)
            continue
        if r.status == "done":
            entry["status"] = "compiled"
            entry["seconds"] = round(entry["seconds"] + r.seconds, 3)
            entry["stages"][r.stage] = round(entry["stages"].get(r.stage, 0.0) + r.seconds, 3)
    total = round(sum(r.seconds for r in reporter.records if r.status == "done"), 3)
    status = "compiled" if any(e["status"] == "compiled" for e in subs.values()) else "reused"
    return {"status": status, "total_s": total, "submodules": subs, "shared": shared}


def _stats(times: list[float]) -> dict:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
    }


def _finite(v):
    """JSON-safe: non-finite floats (an identical image's infinite PSNR) become null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def parity(figure: str, names: list[str], ours: Path, theirs: Path, side: str = "sdiree") -> dict:
    """max |side - torch| on the same inputs, per output (8-bit levels and PSNR for images)."""
    from .verify import compare

    a = np.load(ours)
    b = np.load(theirs)
    outputs = {}
    for i, name in enumerate(names):
        x = a[f"arr_{i}"]
        y = b[f"arr_{i}"]
        if figure == "image":
            d = x.astype(np.float64) - y.astype(np.float64)
            mse = float(np.mean(d**2))
            outputs[name] = {
                "max_abs": float(np.max(np.abs(d))),
                "unit": "8-bit levels",
                "psnr_db": float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse)),
            }
        else:
            max_abs, scale, psnr = compare(y.astype(np.float32), x.astype(np.float32))
            outputs[name] = {
                "max_abs": max_abs,
                "scale": scale,
                "rel": max_abs / scale,
                "psnr_db": psnr,
                "non_finite": [
                    who for who, v in ((side, x), ("torch", y)) if not np.isfinite(v).all()
                ],
            }
    # NaN (a non-finite output) ranks worst.
    worst = max(
        outputs.values(), key=lambda o: math.inf if math.isnan(o["max_abs"]) else o["max_abs"]
    )
    return {
        "max_abs": worst["max_abs"],
        "worst": worst,
        "outputs": outputs,
    }


def _environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for n in ("sdiree", "torch", "diffusers", "transformers", "iree-base-runtime",
              "iree-base-compiler", "iree-turbine", "openvino", "onnxruntime", "onnx"):  # fmt: skip
        try:
            versions[n] = version(n)
        except PackageNotFoundError:
            versions[n] = None
    cpu = platform.processor() or platform.machine()
    flags = None
    try:
        for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):  # what lscpu shows as Flags
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return {
        "versions": versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_flags": flags,
        "avx512_bf16": None if flags is None else "avx512_bf16" in flags,
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _validate(opts: BenchOptions) -> None:
    from sdiree.runtime.errors import UserError

    if opts.runs < 1:
        raise UserError(f"--runs {opts.runs}: at least one timed run is needed")
    if opts.warmup < 0:
        raise UserError(f"--warmup {opts.warmup} must be 0 or more")
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


def _side_stats(rs: list[dict]) -> dict:
    """One side's figure: time stats over the timed runs, peak RSS (and device peak)."""
    timed = [r["seconds"] for r in rs if not r["warmup"]]
    entry = {
        **_stats(timed),
        "times_s": timed,
        "warmup_s": [r["seconds"] for r in rs if r["warmup"]],
        "peak_rss_first_mb": rs[0]["peak_rss_mb"],
        "peak_rss_later_mb": rs[-1]["peak_rss_mb"] if len(rs) > 1 else None,
        "peak_rss_mb": [r["peak_rss_mb"] for r in rs],
    }
    if "device_peak_mb" in rs[-1]:
        entry["device_peak_first_mb"] = rs[0]["device_peak_mb"]
        entry["device_peak_later_mb"] = rs[-1]["device_peak_mb"] if len(rs) > 1 else None
    return entry


def _figure_labels(manifest, steps: int, scheduler: str) -> dict:
    b = manifest.image["batch_size"]
    return {
        "text_encoder": f"text encoder (encode, batch {b})",
        "unet": f"UNet (denoise_cfg, batch {2 * b})",
        "vae_decode": f"VAE decode (batch {b})",
        "image": f"image ({steps} steps, {scheduler})",
    }


def run_bench(opts: BenchOptions, out=None, log=None) -> dict:
    """Compile (or reuse), time both sides, write the JSON, print the markdown; returns the report."""
    from sdiree.runtime import schedulers
    from sdiree.runtime.fileutil import atomic_write_bytes
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.pipeline import scheduler_config

    from .driver import CompileOptions, compile_model
    from .quiet import quiet_libraries
    from .report import Reporter
    from .verify import make_inputs

    out = out or sys.stdout
    log = log or sys.stderr
    _validate(opts)
    peers = _peer_names(opts)
    sides = (*SIDES, *peers)
    quiet_libraries()
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
    compiled = compile_times(reporter)
    art = manifest_path.parent
    manifest = load_manifest(art)
    img = manifest.image
    config = scheduler_config(manifest)
    sched = schedulers.name_for_config(config)
    diffusers_sched = None
    if sched is None:  # no sdiree port of the model's scheduler: both sides use Euler
        sched, diffusers_sched = "euler", "EulerDiscreteScheduler"

    work = Path(tempfile.mkdtemp(prefix="sdiree-bench-"))
    te = manifest.submodules["text_encoder"].functions["encode"].inputs
    te_inputs = make_inputs(manifest, "text_encoder", "encode", opts.seed)
    inputs = {f"text_encoder.{t.name}": a for t, a in zip(te, te_inputs, strict=True)}
    inputs["vae_decode.latents"] = make_inputs(manifest, "vae_decoder", "decode", opts.seed)[0]
    sample, timestep, text = make_inputs(manifest, "unet", "denoise_cfg", opts.seed)
    inputs.update({"unet.sample": sample, "unet.timestep": timestep})
    inputs["unet.encoder_hidden_states"] = text
    np.savez(work / "inputs.npz", **inputs)
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
    }
    if peers:
        from .peers import needs_openvino
        from .peers.export import ensure_models

        formats = ["onnx", "openvino"] if needs_openvino(peers) else ["onnx"]
        spec["peer_models"] = str(
            ensure_models(manifest, Path(opts.model_dir), work / "inputs.npz", formats, work, log)
        )
    (work / "spec.json").write_text(json.dumps(spec, indent=2))
    output_names = {
        "text_encoder": [
            o.name for o in manifest.submodules["text_encoder"].functions["encode"].outputs
        ],
        "unet": [o.name for o in manifest.submodules["unet"].functions["denoise_cfg"].outputs],
        "vae_decode": [
            o.name for o in manifest.submodules["vae_decoder"].functions["decode"].outputs
        ],
        "image": ["pixels"],
    }

    def say(msg: str) -> None:
        print(msg, file=log, flush=True)

    total = opts.warmup + opts.runs
    workers: dict[str, Worker] = {}
    runs: dict[str, dict[str, list[dict]]] = {f: {s: [] for s in sides} for f in FIGURES}
    try:
        for side in sides:
            workers[side] = Worker(side, work / "spec.json", work / f"{side}.log")
        loads = {}
        for side in sides:
            say(f"[bench load {side}] ...")
            loads[side] = workers[side].ask(op="import")
            loads[side].update(workers[side].ask(op="load"))
            say(f"[bench load {side}] done in {loads[side]['seconds']:.1f}s")
        for figure in RUN_ORDER:
            for i in range(total):
                line = []
                for side in sides:
                    save = str(work / f"{side}-{figure}.npz") if i == total - 1 else None
                    r = workers[side].ask(op="run", figure=figure, save=save)
                    r["warmup"] = i < opts.warmup
                    runs[figure][side].append(r)
                    line.append(f"{side} {r['seconds']:.3f}s")
                    time.sleep(SETTLE_S)
                kind = "warm-up" if i < opts.warmup else "run"
                say(f"[bench {figure}] {kind} {i + 1}/{total}: " + ", ".join(line))
    except BaseException:
        for w in workers.values():
            w.close(kill=True)
        say(f"bench: worker logs kept in {work}")
        raise
    for w in workers.values():
        w.close()

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
            "alternation": "sdiree run i, torch run i, ... in two fresh worker processes",
            "timed": "median/min/max over the timed runs, after the warm-up runs",
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


# -- markdown ------------------------------------------------------------------------------------


def _mb(v) -> str:
    return "–" if v is None else f"{v:,.0f}"


def _secs(v: float) -> str:
    return f"{v:.3f}" if v < 10 else f"{v:.2f}"


def _parity_cell(figure: str, p: dict) -> str:
    w = p["worst"]
    if figure == "image":
        psnr = w.get("psnr_db")
        return f"{w['max_abs']:.0f} levels, " + ("identical" if psnr is None else f"{psnr:.1f} dB")
    if w.get("non_finite") or w["max_abs"] is None:
        return f"non-finite output ({', '.join(w.get('non_finite') or ['?'])})"
    return f"{w['max_abs']:.3g} (rel {w['rel']:.2g})"


def _peer_rows(report: dict) -> list[str]:
    """The peers' table: one row per figure and peer, beside sdiree's time on that figure."""
    peers = report.get("peers") or {}
    if not peers:
        return []
    lines = [
        "",
        "| figure | engine | precision | s, median (min–max) | vs sdiree | vs torch "
        "| peak RSS MB, first / later | parity vs torch |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for figure in FIGURES:
        f = report["figures"][figure]
        for peer, info in peers.items():
            e = f["peers"][peer]
            engine = f"{peer} {info.get('version') or ''}".strip()
            lines.append(
                f"| {f['label']} | {engine} | {info.get('precision', '?')} "
                f"| {_secs(e['median_s'])} ({_secs(e['min_s'])}–{_secs(e['max_s'])}) "
                f"| {e['vs_sdiree']:.2f} | {e['vs_torch']:.2f} "
                f"| {_mb(e['peak_rss_first_mb'])} / {_mb(e['peak_rss_later_mb'])} "
                f"| {_parity_cell(figure, e['parity'])} |"
            )
    return lines


def markdown(report: dict) -> str:
    """The report as markdown: one row per figure, then load/memory and compile tables."""
    c = report["config"]
    tc = ", torch.compile" if c["torch_compile"] else ""
    lines = [
        f"### {c['model']}: {c['target']}/{c['arch']} {c['dtype']}, {c['width']}x{c['height']}, "
        f"batch {c['batch_size']}, {c['steps']} steps ({c['scheduler']}); "
        f"torch {c['torch_device']} {c['torch_dtype']}{tc}; "
        f"{c['runs']} runs after {c['warmup']} warm-up",
        "",
        "| figure | sdiree s, median (min–max) | torch s, median (min–max) | sdiree/torch "
        "| sdiree peak RSS MB, first / later | torch peak RSS MB, first / later "
        "| parity max abs diff |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for figure in FIGURES:
        f = report["figures"][figure]
        cells = [f["label"]]
        for side in SIDES:
            s = f[side]
            cells.append(f"{_secs(s['median_s'])} ({_secs(s['min_s'])}–{_secs(s['max_s'])})")
        cells.append(f"{f['ratio']:.2f}")
        for side in SIDES:
            s = f[side]
            cells.append(f"{_mb(s['peak_rss_first_mb'])} / {_mb(s['peak_rss_later_mb'])}")
        cells.append(_parity_cell(figure, f["parity"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += _peer_rows(report)
    figs = [report["figures"][f] for f in FIGURES]
    if any("device_peak_first_mb" in f[side] for f in figs for side in SIDES):
        lines += [
            "",
            "| figure | sdiree device peak MB, first / later | torch device peak MB, first / later |",
            "| --- | ---: | ---: |",
        ]
        for f in figs:
            cells = [f["label"]]
            for side in SIDES:
                s = f[side]
                cells.append(
                    f"{_mb(s.get('device_peak_first_mb'))} / {_mb(s.get('device_peak_later_mb'))}"
                )
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| side | import s | load s | RSS after imports MB | peak RSS while loading MB "
        "| RSS after load MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for side, s in [*report["sides"].items(), *report.get("peers", {}).items()]:
        lines.append(
            f"| {side} | {s['import_s']:.2f} | {s['seconds']:.2f} | {_mb(s['rss_after_imports_mb'])} "
            f"| {_mb(s['peak_rss_load_mb'])} | {_mb(s['rss_after_load_mb'])} |"
        )
    comp = report["compile"]
    lines += ["", "| submodule | compile | seconds |", "| --- | --- | ---: |"]
    for sub, e in comp["submodules"].items():
        lines.append(f"| {sub} | {e['status']} | {e['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "--worker":
        return worker_main(argv[1], Path(argv[2]))
    print("usage: python -m sdiree.compile.bench --worker SIDE SPEC (use `sdiree bench`)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
