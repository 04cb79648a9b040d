"""`sdiree bench` on the tiny SDXL: both text encoders, the UNet's added conditioning and
diffusers' StableDiffusionXLPipeline, with the figures and parity the SD 1.x bench has.

Reuses the session's compiled cpu fp32 SDXL artifact; 2 steps, one timed run, no warm-up.
"""

from __future__ import annotations

import io
import math

import pytest

from sdiree.compile.bench import FIGURES, SIDES, BenchOptions, run_bench
from sdiree.compile.bench_family import bench_calls, figure_outputs
from sdiree.runtime.manifest import load_manifest

STATS = ("median_s", "min_s", "max_s")


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.fixture(scope="module")
def sdxl_art(compiled_sdxl):
    return compiled_sdxl.get("cpu", "host", "fp32")


@pytest.fixture(scope="module")
def sdxl_bench(compiled_sdxl, sdxl_art, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-sdxl") / "report.json"
    out, log = io.StringIO(), io.StringIO()
    report = run_bench(
        BenchOptions(
            model_dir=compiled_sdxl.model,
            target="cpu",
            arch="host",
            dtype="fp32",
            out=sdxl_art,
            steps=2,
            runs=1,
            warmup=0,
            json_path=path,
        ),
        out=out,
        log=log,
    )
    return report, out.getvalue()


def test_sdxl_calls_come_from_its_manifest(sdxl_art):
    m = load_manifest(sdxl_art)
    calls = bench_calls(m)
    assert ("text_encoder", "encode") in calls and ("text_encoder_2", "encode") in calls
    assert calls["unet", "denoise_cfg"] == (
        "unet.sample",
        "unet.timestep",
        "unet.encoder_hidden_states",
        "unet.text_embeds",
        "unet.time_ids",
    )
    text = figure_outputs(m)["text_encoder"]
    assert len(text) == 4 and {n.split(".")[0] for n in text} == {
        "text_encoder",
        "text_encoder_2",
    }


def test_sdxl_bench_figures_and_parity(sdxl_bench):
    report, text = sdxl_bench
    assert set(report["figures"]) == set(FIGURES)
    for name, fig in report["figures"].items():
        for side in SIDES:
            s = fig[side]
            assert all(number(s[k]) and s[k] > 0 for k in STATS), (name, side, s)
            assert len(s["times_s"]) == 1 and s["warmup_s"] == []
            assert number(s["peak_rss_first_mb"]) and s["peak_rss_first_mb"] > 0
        assert number(fig["ratio"]) and fig["ratio"] > 0
        p = fig["parity"]
        assert number(p["max_abs"]) and p["outputs"]
        assert all(number(o["max_abs"]) for o in p["outputs"].values())
    te = report["figures"]["text_encoder"]
    assert te["label"].startswith("2 text encoders")
    # both encoders' hidden states and pooled outputs compared, each under its submodule
    assert len(te["parity"]["outputs"]) == 4
    assert any(k.startswith("text_encoder_2.") for k in te["parity"]["outputs"])
    # the same tolerances as the SD 1.x bench: tiny fp32 components agree closely, images nearly
    for name in ("text_encoder", "unet", "vae_decode"):
        assert report["figures"][name]["parity"]["worst"]["rel"] < 1e-3, name
    assert report["figures"]["image"]["parity"]["max_abs"] <= 8
    assert set(report["compile"]["submodules"]) == {
        "text_encoder",
        "text_encoder_2",
        "unet",
        "vae_decoder",
        "vae_encoder",
    }
    assert report["sides"]["sdiree"]["torch_imported"] is False
    assert report["sides"]["torch"]["scheduler"] == "EulerDiscreteScheduler"
    assert f"| {te['label']} |" in text
