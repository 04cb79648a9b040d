"""`sdiree bench --peers`: OpenVINO and ONNX Runtime beside sdiree and torch on the tiny models.

One bench (1 run, no warm-up, 2 steps) with every peer reuses the session's compiled cpu
artifact; the peers' models are exported once into the folder beside it. Tolerances: the fp32
peers run the same fp32 graph as torch in another order of operations, so they agree to float32
rounding grown through the tiny model's layers (seen: ~1e-6 relative on the UNet): 1e-4 is
verify.py's fp32 gate, with two orders of margin. OpenVINO's default hint is bf16 where the CPU
has avx512_bf16 or AMX (8-bit mantissa: seen ~2e-2 on the UNet), where verify.py's bf16 gate,
1e-1, applies. The tiny SDXL's bench shows the peers take that family's calls too: both text
encoders (penultimate hidden states, the second's pooled projection) and the UNet's added
``text_embeds`` and ``time_ids``.
"""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sdiree.compile.bench import FIGURES, BenchOptions, run_bench
from sdiree.compile.peers import PEERS, PEERS_HINT, parse_peers
from sdiree.runtime.errors import UserError

needs_peers = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("openvino", "onnxruntime", "onnx")),
    reason="needs the peers extra",
)
FP32_TOL = 1e-4
BF16_TOL = 1e-1


def _bench(compiled, path, peers: str, steps: int):
    """One bench of the session's cpu fp32 artifact with peers (1 run, no warm-up): the
    report, its markdown and its log."""
    out, log = io.StringIO(), io.StringIO()
    report = run_bench(
        BenchOptions(
            model_dir=compiled.model,
            target="cpu",
            arch="host",
            dtype="fp32",
            out=compiled.get("cpu", "host", "fp32"),
            steps=steps,
            runs=1,
            warmup=0,
            json_path=path,
            peers=peers,
        ),
        out=out,
        log=log,
    )
    return report, out.getvalue(), log.getvalue()


@pytest.fixture(scope="module")
def peers_bench(compiled, tmp_path_factory):
    path = tmp_path_factory.mktemp("peers") / "report.json"
    report, out, log = _bench(compiled, path, "openvino,onnxruntime", steps=2)
    return report, out, log, path


@needs_peers
def test_peers_have_rows_times_and_parity(peers_bench):
    report, text, _, path = peers_bench
    peers = ["openvino-f32", "openvino-default", "onnxruntime"]
    assert report["config"]["peers"] == peers and list(report["peers"]) == peers
    for peer in peers:
        info = report["peers"][peer]
        assert info["version"] and info["torch_imported"] is False
        assert info["pid"] not in (report["sides"][s]["pid"] for s in ("sdiree", "torch"))
    assert report["peers"]["onnxruntime"]["precision"] == "fp32"
    assert report["peers"]["openvino-f32"]["precision"] == "f32"
    default = report["peers"]["openvino-default"]["precision"]
    assert default in ("f32", "bf16")
    if report["environment"]["avx512_bf16"]:
        assert default == "bf16"  # OpenVINO's CPU plugin picks bf16 where the CPU has it
    _check_peer_rows(report, peers)
    fp32_image = report["figures"]["image"]["peers"]["onnxruntime"]["parity"]["worst"]
    assert fp32_image["max_abs"] <= 8  # as sdiree's own fp32 image in test_bench.py
    # the markdown's peers table: one row per figure and peer
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and " | onnxruntime " in ln]
    assert len(rows) == len(FIGURES)
    assert json.loads(path.read_text())["peers"]["openvino-f32"]["precision"] == "f32"


@needs_peers
def test_peer_models_are_cached_in_the_user_cache(peers_bench, compiled, compile_cache, tmp_path):
    report, _, log, _ = peers_bench
    folder = report["method"]["peer_models"]
    art = report["config"]["artifact_dir"]
    assert folder.startswith(str(compile_cache / "peers"))
    assert art not in folder  # never inside the artifact (its manifest lists its files)
    names = sorted(p.name for p in Path(folder).iterdir())
    assert names == ["onnx", "openvino"]  # no temporary folder left
    # a second bench reuses them: nothing exported
    out, log2 = io.StringIO(), io.StringIO()
    run_bench(
        BenchOptions(
            model_dir=compiled.model,
            target="cpu",
            out=Path(art),
            steps=1,
            runs=1,
            warmup=0,
            json_path=tmp_path / "second.json",
            peers="onnxruntime",
        ),
        out=out,
        log=log2,
    )
    assert "exporting" in log and "exporting" not in log2.getvalue()


def _check_peer_rows(report: dict, peers: list[str]) -> None:
    """Every figure has every peer's time, memory and parity within its precision's tolerance."""
    for figure in FIGURES:
        for peer in peers:
            e = report["figures"][figure]["peers"][peer]
            assert e["median_s"] > 0 and e["vs_sdiree"] > 0 and e["peak_rss_first_mb"] > 0
            worst = e["parity"]["worst"]
            if figure == "image":
                assert worst["psnr_db"] is None or worst["psnr_db"] > 20, (peer, worst)
                continue
            tol = BF16_TOL if report["peers"][peer]["precision"] == "bf16" else FP32_TOL
            assert 0 <= worst["rel"] < tol, (figure, peer, worst)


@needs_peers
def test_sdxl_peers_take_both_text_encoders_and_the_added_conditioning(
    compiled_sdxl, tmp_path_factory
):
    path = tmp_path_factory.mktemp("peers-sdxl") / "report.json"
    report, _, _ = _bench(compiled_sdxl, path, "openvino-f32,onnxruntime", steps=1)
    peers = ["openvino-f32", "onnxruntime"]
    _check_peer_rows(report, peers)
    # both encoders' hidden states and pooled outputs, compared under their submodules
    for peer in peers:
        outputs = report["figures"]["text_encoder"]["peers"][peer]["parity"]["outputs"]
        assert len(outputs) == 4 and any(k.startswith("text_encoder_2.") for k in outputs)
    folder = Path(report["method"]["peer_models"])
    for sub in ("text_encoder", "text_encoder_2", "unet", "vae_decoder"):
        assert (folder / "onnx" / f"{sub}.onnx").is_file()
        assert (folder / "openvino" / f"{sub}.xml").is_file()
    # the UNet's added conditioning reaches the peers' graphs as inputs, not as constants
    import onnx

    unet = onnx.load(str(folder / "onnx" / "unet.onnx"), load_external_data=False)
    assert [i.name for i in unet.graph.input] == [
        "sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"
    ]  # fmt: skip


def test_parse_peers_expands_aliases_and_refuses_unknown_names():
    assert parse_peers("openvino, onnxruntime") == [
        "openvino-f32",
        "openvino-default",
        "onnxruntime",
    ]
    assert parse_peers("ort,onnxruntime") == ["onnxruntime"]
    assert parse_peers(None) == [] and parse_peers("") == []
    with pytest.raises(UserError, match="unknown peer 'tensorrt'"):
        parse_peers("openvino,tensorrt")
    assert set(PEERS) == {"onnxruntime", "openvino-f32", "openvino-default"}


@pytest.mark.parametrize("blocked", ["openvino", "onnxruntime"])
def test_cli_bench_peers_without_the_extra_says_how_to_install(blocked, tmp_path):
    # "nowhere" is not a model: the check must come before any compile or export.
    blocker = textwrap.dedent(
        f"""
        import sys
        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name == {blocked!r} or name.startswith({blocked!r} + "."):
                    raise ImportError(f"blocked {{name}}")
        sys.meta_path.insert(0, Blocker())
        sys.argv = ["sdiree", "bench", {str(tmp_path / "nowhere")!r}, "--target", "cpu",
                    "--peers", "openvino,onnxruntime"]
        from sdiree.runtime.cli import main
        main()
        """
    )
    proc = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert f"missing: {blocked}" in lines[0] and PEERS_HINT in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_cli_bench_unknown_peer_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "bench", "nowhere", "--target", "cpu",
         "--peers", "tensorrt"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --peers: unknown peer 'tensorrt'")


def test_stale_export_folders_of_dead_processes_are_removed(tmp_path):
    from sdiree.compile.peers.export import remove_stale_dirs

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)  # fmt: skip
    dead = int(done.stdout)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for name in (f".onnx.{dead}.tmp", f".openvino.{alive.pid}.tmp", "onnx"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "unet.onnx").write_bytes(b"x")
        remove_stale_dirs(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f".openvino.{alive.pid}.tmp", "onnx"]
    finally:
        alive.kill()
        alive.wait()


def test_a_killed_export_names_the_signal_not_its_last_warning(tmp_path):
    from sdiree.compile.peers.export import _failed

    log = tmp_path / "peers-export.log"
    log.write_text("exported text_encoder.onnx\nTracerWarning: assert hidden_states.shape[1]\n")
    killed = _failed(-9, log)
    assert "killed by SIGKILL" in killed and "out of memory" in killed and str(log) in killed
    assert "TracerWarning" not in killed
    failed = _failed(1, log)
    assert "(exit 1): TracerWarning" in failed and str(log) in failed


def test_the_export_traces_without_autograd(compiled, monkeypatch, tmp_path):
    # Traced with grad on, torch keeps every activation for a backward pass: SDXL's UNet
    # export at 1024² was killed at 24 GB.
    import torch

    from sdiree.compile.bench_family import bench_calls
    from sdiree.compile.peers import export
    from sdiree.compile.verify import make_inputs
    from sdiree.runtime.manifest import load_manifest

    manifest = load_manifest(compiled.get("cpu", "host", "fp32"))
    inputs = {}
    for (sub, fn), names in bench_calls(manifest).items():
        inputs.update(zip(names, make_inputs(manifest, sub, fn, 0), strict=True))
    seen = []

    class Traced(Exception):
        pass

    def fake_export(module, args, path, **kwargs):
        seen.append(torch.is_grad_enabled())
        raise Traced

    monkeypatch.setattr(torch.onnx, "export", fake_export)
    with pytest.raises(Traced):
        export.export_onnx(compiled.model, manifest, inputs, tmp_path)
    assert seen == [False]
