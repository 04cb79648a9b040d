"""Parity gate: each compiled submodule against its torch module on the same inputs.

Inputs are drawn from a fixed seed; the torch reference runs in fp32 (for an fp16 artifact, on
the fp16-rounded weights and inputs, so only the compiled arithmetic differs). Reported per
output: max abs difference, the output's scale (max |ref|), their ratio, and PSNR over the
reference's range. The ratio must stay within TOLERANCE for the artifact's dtype.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from sdiree.runtime.device import find_device, list_devices
from sdiree.runtime.errors import UserError
from sdiree.runtime.manifest import Manifest, load_manifest
from sdiree.runtime.session import with_fresh_device_on_loss

from .quiet import quiet_libraries

# max |iree - torch| / max |torch| per output. fp16 rounds every intermediate to ~1e-3 relative;
# through the VAE encoder's ~30 layers that grows to ~2e-2 of its small output (seen: 2.15e-2).
# bf16 (cpu: matmul inputs rounded to bf16, fp32 accumulation) keeps 8 bits of mantissa: ~4e-3
# per rounding, 8x fp16's.
TOLERANCE = {"fp32": 1e-4, "fp16": 5e-2, "bf16": 1e-1}


@dataclass
class ParityResult:
    submodule: str
    function: str
    output: str
    max_abs: float
    scale: float
    rel: float
    psnr_db: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.rel)) and self.rel <= self.tolerance

    def line(self) -> str:
        mark = "ok" if self.ok else "FAIL"
        return (
            f"{self.submodule}.{self.function}:{self.output} max|d|={self.max_abs:.3g} "
            f"scale={self.scale:.3g} rel={self.rel:.3g} (tol {self.tolerance:g}) "
            f"psnr={self.psnr_db:.1f}dB {mark}"
        )

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def make_inputs(manifest: Manifest, submodule: str, function: str, seed: int) -> list[np.ndarray]:
    """Deterministic, realistic inputs for one entry function."""
    rng = np.random.default_rng(seed)
    decl = manifest.submodules[submodule].functions[function]
    out = []
    for t in decl.inputs:
        if t.name == "input_ids":
            ids = rng.integers(1, 300, size=t.shape, dtype=np.int64)
            ids[:, 0] = 0  # bos-like first token
            ids[:, 12] = ids.max() + 1  # a distinct id to pool on
            out.append(ids)
        elif t.name == "eos_index":
            out.append(np.full(t.shape, 12, dtype=np.int64))  # the end token's position
        elif t.name == "timestep":
            out.append(np.array([500.0], dtype=np.float32))
        elif t.name == "time_ids":  # SDXL's (original size, crop top-left, target size)
            img = manifest.image
            ids = [img["height"], img["width"], 0, 0, img["height"], img["width"]]
            out.append(np.broadcast_to(np.array(ids[: t.shape[-1]], t.dtype), t.shape).copy())
        elif t.name == "image":
            out.append(rng.uniform(-1, 1, size=t.shape).astype(t.dtype))
        else:
            out.append(rng.standard_normal(size=t.shape).astype(t.dtype))
    return out


def _torch_reference(model_dir: Path, manifest: Manifest):
    """{submodule: callable(list[np]) -> list[np]} built from the model's torch components."""
    import torch

    from .exporters.text_encoder import TextEncoderEntry
    from .exporters.unet import UNetEntry
    from .exporters.vae import VaeDecodeEntry, VaeEncodeEntry
    from .model_source import open_model

    model = open_model(model_dir)
    cache = {}

    def component(name, submodule):
        # weights rounded to fp16 where the module computes in fp16 (not an upcast fp32 VAE)
        decl = next(iter(manifest.submodules[submodule].functions.values()))
        rounding = any(t.dtype == "float16" for t in decl.inputs)
        if (name, rounding) not in cache:
            m = model.load(name, torch.float32).eval()  # the reference computes in fp32
            if rounding:
                m = m.half().float()
            cache[name, rounding] = m
        return cache[name, rounding]

    sf = manifest.data["vae_scaling"]["factor"]
    entries = {
        "unet": lambda: UNetEntry(component("unet", "unet")),
        "vae_decoder": lambda: VaeDecodeEntry(component("vae", "vae_decoder"), sf),
        "vae_encoder": lambda: VaeEncodeEntry(component("vae", "vae_encoder"), sf),
    }
    for te in manifest.data["text_encoders"]:  # each with its recipe's hidden states
        sub = te.get("submodule", "text_encoder")
        entries[sub] = lambda sub=sub, te=te: TextEncoderEntry(
            component(sub, sub), te.get("hidden_states", "last")
        )

    def run(submodule, inputs):
        entry = entries[submodule]()
        tensors = [
            torch.from_numpy(a.astype(np.float32) if a.dtype == np.float16 else a) for a in inputs
        ]
        with torch.no_grad():
            outs = entry(*tensors)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return [o.float().numpy() for o in outs]

    return run


def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, float, float]:
    ref = ref.astype(np.float64)
    got = got.astype(np.float64)
    max_abs = float(np.max(np.abs(ref - got))) if ref.size else 0.0
    scale = float(np.max(np.abs(ref))) or 1.0
    mse = float(np.mean((ref - got) ** 2))
    peak = float(ref.max() - ref.min()) or 1.0
    psnr = float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse)
    if not np.all(np.isfinite(got)):
        max_abs, psnr = float("nan"), float("nan")
    return max_abs, scale, psnr


def check_parity(
    artifact_dir: Path,
    model_dir: Path | None = None,
    device: str | None = None,
    submodules: list[str] | None = None,
    seed: int = 0,
    functions: list[str] | None = None,
) -> list[ParityResult]:
    quiet_libraries()
    manifest = load_manifest(artifact_dir)
    model_dir = Path(model_dir or manifest.data["model"]["source"])
    driver = manifest.driver
    if device:
        info = find_device(device, driver)
    else:
        devices = list_devices(driver)
        if not devices:
            raise UserError(f"no {driver} device here to verify {manifest.target} modules on")
        info = devices[0]
    subs = submodules or list(manifest.submodules)
    reference = _torch_reference(model_dir, manifest)
    return with_fresh_device_on_loss(
        manifest,
        info,
        subs,
        lambda session: _compare_all(session, manifest, subs, reference, seed, functions),
        warn=lambda msg: print(f"warning: {msg}", file=sys.stderr),
    )


def _compare_all(session, manifest, subs, reference, seed, functions=None) -> list[ParityResult]:
    tol = TOLERANCE[manifest.dtype]
    results = []
    for sub in subs:
        for fname, decl in manifest.submodules[sub].functions.items():
            if functions and fname not in functions:
                continue
            inputs = make_inputs(manifest, sub, fname, seed)
            got = session.call(sub, fname, *inputs)
            ref = reference(sub, inputs)
            for o, r, g in zip(decl.outputs, ref, got, strict=True):
                max_abs, scale, psnr = compare(r, g)
                results.append(
                    ParityResult(sub, fname, o.name, max_abs, scale, max_abs / scale, psnr, tol)
                )
    return results


def main(argv: list[str] | None = None) -> int:
    """`python -m sdiree.compile.verify ARTIFACT_DIR [--model DIR] [--device D]`: exit 1 on a FAIL."""
    import argparse

    ap = argparse.ArgumentParser(description="Parity of each compiled submodule against torch.")
    ap.add_argument("artifact_dir", type=Path)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: recorded)")
    ap.add_argument("--device", "-d", default=None, help="device (default: the driver's first)")
    ap.add_argument("--submodules", default=None, help="comma-separated (default: all)")
    ap.add_argument(
        "--functions", default=None, help="comma-separated entry functions (default: all)"
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        results = check_parity(
            a.artifact_dir,
            a.model,
            a.device,
            a.submodules.split(",") if a.submodules else None,
            a.seed,
            a.functions.split(",") if a.functions else None,
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results:
        print(r.line())
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
