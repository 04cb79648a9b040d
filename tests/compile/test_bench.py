"""`sdiree bench` on the tiny model: the report's shape, its JSON and its markdown (never times).

The bench reuses the session's compiled cpu artifact (same options, same --out), so nothing is
compiled twice; one run after one warm-up at 2 steps keeps it to seconds of model work.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from sdiree.compile.bench import (
    FIGURES,
    SIDES,
    BenchOptions,
    _finite,
    _parity_cell,
    device_peak_mb,
    markdown,
    parity,
    run_bench,
)

STATS = ("median_s", "min_s", "max_s")


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@pytest.fixture(scope="module")
def cpu_art(compiled):
    return compiled.get("cpu", "host", "fp32")


@pytest.fixture(scope="module")
def bench(compiled, cpu_art, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "report.json"
    out, log = io.StringIO(), io.StringIO()
    report = run_bench(
        BenchOptions(
            model_dir=compiled.model,
            target="cpu",
            arch="host",
            dtype="fp32",
            out=cpu_art,
            steps=2,
            runs=1,
            warmup=1,
            json_path=path,
        ),
        out=out,
        log=log,
    )
    return report, out.getvalue(), path


def test_every_figure_has_stats_ratio_memory_and_parity(bench):
    report, _, _ = bench
    assert set(report["figures"]) == set(FIGURES)
    for name, fig in report["figures"].items():
        for side in SIDES:
            s = fig[side]
            assert all(number(s[k]) and s[k] > 0 for k in STATS), (name, side, s)
            assert s["min_s"] <= s["median_s"] <= s["max_s"]
            assert len(s["times_s"]) == 1 and len(s["warmup_s"]) == 1
            assert number(s["peak_rss_first_mb"]) and s["peak_rss_first_mb"] > 0
            assert number(s["peak_rss_later_mb"]) and s["peak_rss_later_mb"] > 0
        assert number(fig["ratio"]) and fig["ratio"] > 0
        p = fig["parity"]
        assert number(p["max_abs"]) and p["outputs"]
        for out in p["outputs"].values():
            assert number(out["max_abs"])
    # tiny fp32 model: the components agree closely and the images nearly exactly
    for name in ("text_encoder", "unet", "vae_decode"):
        assert report["figures"][name]["parity"]["worst"]["rel"] < 1e-3
    assert report["figures"]["image"]["parity"]["max_abs"] <= 8


def test_compile_times_sides_and_config(bench):
    report, _, _ = bench
    comp = report["compile"]
    assert comp["status"] in ("reused", "compiled") and number(comp["total_s"])
    for sub in ("text_encoder", "unet", "vae_decoder", "vae_encoder"):
        e = comp["submodules"][sub]
        assert e["status"] in ("reused", "compiled") and number(e["seconds"])
    for side in SIDES:
        s = report["sides"][side]
        for k in (
            "import_s",
            "seconds",
            "rss_after_imports_mb",
            "peak_rss_load_mb",
            "rss_after_load_mb",
        ):
            assert number(s[k]), (side, k)
    # each side runs in its own process; the sdiree one never imports torch
    assert report["sides"]["sdiree"]["torch_imported"] is False
    assert report["sides"]["torch"]["torch_imported"] is True
    assert report["sides"]["sdiree"]["pid"] != report["sides"]["torch"]["pid"]
    c = report["config"]
    assert (c["target"], c["dtype"], c["steps"], c["runs"], c["warmup"]) == ("cpu", "fp32", 2, 1, 1)
    # each run two calls in a row, the second timed (a denoising loop's steady state)
    assert c["back_to_back"] == 2
    assert "2 call(s) back to back, the last one timed" in report["method"]["timed"]
    assert (c["height"], c["width"]) == (64, 64)


def test_json_is_written_and_loads(bench):
    report, _, path = bench
    loaded = json.loads(path.read_text())
    assert loaded["schema"] == "sdiree-bench/1"
    assert set(loaded["figures"]) == set(FIGURES)
    assert (
        loaded["figures"]["unet"]["sdiree"]["median_s"]
        == report["figures"]["unet"]["sdiree"]["median_s"]
    )


def test_markdown_has_one_row_per_figure(bench):
    report, text, _ = bench
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| figure |"))
    rows = []
    for ln in lines[header + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append(ln)
    assert len(rows) == len(FIGURES)
    for row, name in zip(rows, FIGURES, strict=True):
        assert row.startswith(f"| {report['figures'][name]['label']} |")
        assert row.count("|") == 8


def sdiree(*args):
    return subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_bench(compiled, cpu_art, tmp_path):
    path = tmp_path / "cli.json"
    proc = sdiree("bench", compiled.model, "--target", "cpu", "--out", cpu_art, "--runs", 1,
                  "--warmup", 0, "--steps", 2, "--json", path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "| figure |" in proc.stdout and "| image (2 steps" in proc.stdout
    report = json.loads(path.read_text())
    assert report["config"]["warmup"] == 0
    assert report["figures"]["unet"]["sdiree"]["peak_rss_later_mb"] is None  # only one run


def test_alternated_sides_share_the_machine(bench):
    report, _, _ = bench
    (s0, s1), (t0, t1) = (report["sides"][side]["worker_s"] for side in ("sdiree", "torch"))
    assert s0 < t1 and t0 < s1  # both workers alive at once, calls alternated
    assert report["method"]["alternation"].startswith("sdiree run i, torch run i")


def test_cli_bench_in_turn_runs_one_worker_at_a_time(compiled, cpu_art, tmp_path):
    path = tmp_path / "in-turn.json"
    proc = sdiree("bench", compiled.model, "--target", "cpu", "--out", cpu_art, "--runs", 1,
                  "--warmup", 0, "--steps", 2, "--in-turn", "--json", path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(path.read_text())
    (s0, s1), (t0, t1) = (report["sides"][side]["worker_s"] for side in ("sdiree", "torch"))
    assert s0 < s1 <= t0 < t1, (s0, s1, t0, t1)  # sdiree's worker closed before torch's started
    assert report["method"]["alternation"].startswith("in turn")
    for figure in FIGURES:  # every figure still timed and compared on both sides
        entry = report["figures"][figure]
        assert number(entry["ratio"]) and entry["parity"]["worst"] is not None, figure
    assert report["figures"]["image"]["parity"]["max_abs"] <= 8  # as when alternated


def test_cli_bench_torch_in_another_dtype(compiled, cpu_art, tmp_path):
    # e.g. a cuda fp32 artifact against torch fp16: torch's inputs are cast to its dtype
    path = tmp_path / "bf16.json"
    proc = sdiree("bench", compiled.model, "--target", "cpu", "--out", cpu_art, "--runs", 1,
                  "--warmup", 0, "--steps", 2, "--torch-dtype", "bf16", "--json", path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(path.read_text())
    assert report["config"]["torch_dtype"] == "bfloat16" and report["config"]["dtype"] == "fp32"
    unet = report["figures"]["unet"]["parity"]["worst"]
    assert number(unet["rel"]) and 0 < unet["rel"] < 0.5, unet  # bf16 rounding, not garbage


@pytest.mark.parametrize(
    "args,says",
    [
        (("--target", "cpu", "--runs", 0), "--runs 0"),
        (("--target", "vulkan-spirv", "--torch-device", "mps"), "--torch-device mps"),
        (("--target", "cpu", "--torch-dtype", "int8"), "--torch-dtype int8"),
        (("--target", "cpu", "--back-to-back", 0), "--back-to-back 0"),
    ],
    ids=["runs", "torch-device", "torch-dtype", "back-to-back"],
)
def test_cli_bench_bad_option_is_one_line(args, says):
    proc = sdiree("bench", "nowhere", *args)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0]


@pytest.mark.parametrize("where", ["under-a-file", "unwritable-dir"])
def test_cli_bench_unwritable_json_is_refused_before_any_work(tmp_path, where):
    # "nowhere" is not a model: the --json check must come first, before compiling or timing.
    if where == "under-a-file":
        (tmp_path / "file").write_text("")
        path, says = tmp_path / "file" / "sub" / "bench.json", "is not a directory"
    else:
        sysfs = Path("/sys")
        if not sysfs.is_dir():
            pytest.skip("needs Linux sysfs, where not even root may create a file")
        path, says = sysfs / "bench.json", "cannot write in /sys"
    proc = sdiree("bench", tmp_path / "nowhere", "--target", "cpu", "--json", path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: --json {path}") and says in lines[0]
    assert not path.exists() and sorted(p.name for p in tmp_path.iterdir()) <= ["file"]


def test_parity_names_the_side_with_a_non_finite_output(tmp_path):
    # A miscompiled fp16 module (seen: cuda in iree 3.13) returns inf/NaN; the report must say
    # so instead of failing to format it.
    ref = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    bad = ref.copy()
    bad[1, 2] = np.nan
    np.savez(tmp_path / "ours.npz", bad, ref)
    np.savez(tmp_path / "theirs.npz", ref, ref)
    p = parity("unet", ["noise_pred", "other"], tmp_path / "ours.npz", tmp_path / "theirs.npz")
    assert p["outputs"]["noise_pred"]["non_finite"] == ["sdiree"]
    assert p["outputs"]["other"]["non_finite"] == [] and p["outputs"]["other"]["max_abs"] == 0
    assert p["worst"] is p["outputs"]["noise_pred"]
    assert _parity_cell("unet", _finite(p)) == "non-finite output (sdiree)"
    assert _parity_cell("unet", _finite(parity("unet", ["o"], tmp_path / "theirs.npz",
                                             tmp_path / "theirs.npz"))).startswith("0 (rel 0")  # fmt: skip


def test_cli_bench_without_compile_extra_says_how_to_install():
    blocker = textwrap.dedent(
        """
        import sys
        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError(f"blocked {name}")
        sys.meta_path.insert(0, Blocker())
        sys.argv = ["sdiree", "bench", "somewhere", "--target", "cpu"]
        from sdiree.runtime.cli import main
        main()
        """
    )
    proc = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "pip install 'sdiree[compile]'" in proc.stderr and "Traceback" not in proc.stderr


def test_sd15_random_tokenizer_has_clip_ids(tmp_path):
    from make_sd15_random import CLIP_VOCAB_SIZE, pad_vocabulary
    from tiny_tokenizer import write_tiny_clip_tokenizer

    from sdiree.runtime.tokenizer import ClipTokenizer

    write_tiny_clip_tokenizer(tmp_path, seed=0)
    pad_vocabulary(tmp_path)
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert len(vocab) == CLIP_VOCAB_SIZE == len(set(vocab.values()))
    assert vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    ids = ClipTokenizer.from_dir(tmp_path).encode("a lighthouse at dusk").ids
    assert ids[0] == 49406 and 49407 in ids and max(ids) == 49407


def test_device_peak_is_the_allocators_high_water_mark():
    import iree.runtime as rt

    device = rt.get_device("local-task")
    before = device_peak_mb(device)
    assert before is not None and before >= 0
    buf = device.allocator.allocate_buffer(
        memory_type=rt.MemoryType.DEVICE_LOCAL,
        allowed_usage=rt.BufferUsage.DEFAULT,
        allocation_size=3 << 20,
    )
    # The mark is the most ever allocated at once: at least this buffer, and never below before
    # (earlier tests' buffers on the shared device may have been freed since).
    assert device_peak_mb(device) >= max(before, 3)
    del buf


def test_markdown_shows_device_peaks_when_a_side_has_them(bench):
    report, out, _ = bench
    assert "device peak" not in out  # cpu: memory is RSS only
    gpu = json.loads(json.dumps(report))
    for f in gpu["figures"].values():
        f["sdiree"].update(device_peak_first_mb=2048.0, device_peak_later_mb=2100.0)
        f["torch"].update(device_peak_first_mb=1500.0, device_peak_later_mb=None)
    md = markdown(gpu)
    assert "| figure | sdiree device peak MB, first / later |" in md
    assert md.count("| 2,048 / 2,100 | 1,500 / – |") == len(FIGURES)
