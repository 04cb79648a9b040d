"""`sdiree bench`'s report: the figures' statistics, parity, environment, and the markdown.

Turns the workers' replies into the report's entries (median/min/max over the timed runs, peak
RSS of the first and last run, device peaks), compares the two sides' saved outputs (max abs
difference, scale and ratio; 8-bit levels and PSNR for images), records the environment
(versions, CPU and its flags, load average) and renders the report as markdown tables.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from pathlib import Path

import numpy as np

from .bench_sides import FIGURES, SIDES

SUBMODULE_OF_ITEM = {"vae": "vae_decoder"}  # the VAE's load and shared archive


def compile_times(reporter, submodules=None) -> dict:
    """Seconds per submodule (the artifact's, SD 1.x's by default) from the compile Reporter;
    'reused' when nothing was redone."""
    from .driver import SUBMODULES

    subs = {s: {"status": "reused", "seconds": 0.0, "stages": {}} for s in submodules or SUBMODULES}
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
    from sdiree.runtime.conditioning import text_encoder_submodules

    b = manifest.image["batch_size"]
    encoders = text_encoder_submodules(manifest)
    text = (
        f"text encoder (encode, batch {b})"
        if len(encoders) == 1
        else f"{len(encoders)} text encoders ({' + '.join(encoders)} encode, batch {b})"
    )
    return {
        "text_encoder": text,
        "unet": f"UNet (denoise_cfg, batch {2 * b})",
        "vae_decode": f"VAE decode (batch {b})",
        "image": f"image ({steps} steps, {scheduler})",
    }


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
