"""Recompiles: unchanged inputs are a no-op; a changed flag or tuning spec recompiles only what
it touches; a compile killed midway leaves no manifest and the next run completes it."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdiree.compile import encoded_stage
from sdiree.compile.driver import CompileOptions, compile_model
from sdiree.compile.report import Reporter
from sdiree.runtime.manifest import check_files, load_manifest
from sdiree.runtime.targets import default_specs_dir
from sdiree.runtime.weights import repack
from sdiree.runtime.weights.recover import sidecar_path

DATA = Path(__file__).parent / "data"


def recompile(model, out, specs=None, target="cpu", arch="host"):
    rep = Reporter(stream=io.StringIO())
    compile_model(
        CompileOptions(
            model_dir=model, target=target, arch=arch, dtype="fp32", out=out, specs_dir=specs
        ),
        rep,
    )
    ran = {(r.stage, r.item) for r in rep.records if r.status == "done"}
    return ran, rep.stream.getvalue()


def test_recompile_is_a_noop(compiled):
    out = compiled.get("cpu", "host", "fp32")
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.vmfb")}
    ran, log = recompile(compiled.model, out)
    assert "up to date" in log
    assert not {stage for stage, _ in ran} & {"export", "parameters", "compile", "load"}
    assert before == {p.name: p.stat().st_mtime_ns for p in out.glob("*.vmfb")}


def recompiled(out: Path, submodule: str, ran: set) -> bool:
    """Whether ran is what a cpu flag or spec change reruns: the compile and, since the
    weights' repack depends on it, the parameter encoder and learning its layout; and pruning
    the original archives the submodule loads where its vmfb changed (the keys it names)."""
    m = load_manifest(out)
    core = {("compile", submodule), ("encode", submodule), ("layout", submodule)}
    pruned = {
        ("prune", Path(path).name)
        for path, _ in m.submodules[submodule].archives()
        if sidecar_path(m.path(path)).is_file()
    }
    if m.data["submodules"][submodule]["export"].get("amx_operands") == "bf16x3":
        # its encoded weights are computed, not laid out: no layout, nothing pruned
        core.discard(("layout", submodule))
        assert not pruned, pruned
    else:
        assert pruned, f"{submodule}'s original archives were not pruned"
    return core <= ran - {("hash", "model")} <= core | pruned


def _specs_copy(tmp_path) -> Path:
    specs = tmp_path / "specs"
    shutil.copytree(default_specs_dir(), specs, ignore=shutil.ignore_patterns("__pycache__"))
    return specs


def _flag_change_recompiles_only(model, out, tmp_path, submodule: str, other: str):
    """Give submodule a cpu flag in a specs copy and recompile out: only submodule's stages run,
    and only its manifest entry has the flag (other's has not). Returns (specs, registry)."""
    specs = _specs_copy(tmp_path)
    reg = json.loads((specs / "targets.json").read_text())
    reg["targets"]["cpu"]["submodule_flags"][submodule] = ["--iree-opt-strip-assertions=true"]
    (specs / "targets.json").write_text(json.dumps(reg))
    ran, _ = recompile(model, out, specs)
    assert recompiled(out, submodule, ran), ran
    m = load_manifest(out)
    check_files(m)
    assert "--iree-opt-strip-assertions=true" in m.data["submodules"][submodule]["flags"]
    assert "--iree-opt-strip-assertions=true" not in m.data["submodules"][other]["flags"]
    return specs, reg


def test_changed_flag_or_spec_recompiles_only_what_it_touches(compiled, tmp_path):
    base = compiled.get("cpu", "host", "fp32")
    out = base.parent / "cpu-flag-change"
    shutil.copytree(base, out)
    specs, reg = _flag_change_recompiles_only(compiled.model, out, tmp_path, "vae_decoder", "unet")

    # A tuning spec for the text encoder only, then a change to that spec.
    (specs / "tuning").mkdir(exist_ok=True)
    shutil.copy(DATA / "noop_tuning_spec.mlir", specs / "tuning" / "test_te.mlir")
    reg["targets"]["cpu"]["tuning_specs"]["text_encoder"] = "tuning/test_te.mlir"
    (specs / "targets.json").write_text(json.dumps(reg))
    ran, _ = recompile(compiled.model, out, specs)
    assert recompiled(out, "text_encoder", ran), ran
    spec_hashes = load_manifest(out).data["submodules"]["text_encoder"]["tuning_specs"]
    assert list(spec_hashes) == ["tuning/test_te.mlir"]

    with open(specs / "tuning" / "test_te.mlir", "a") as f:
        f.write("// changed\n")
    ran, _ = recompile(compiled.model, out, specs)
    assert recompiled(out, "text_encoder", ran), ran
    assert load_manifest(out).data["submodules"]["text_encoder"]["tuning_specs"] != spec_hashes


def _state(out: Path) -> dict:
    try:
        return json.loads((out / ".build-state.json").read_text())
    except (OSError, ValueError):  # not written yet
        return {}


def test_killed_compile_leaves_no_manifest_and_resumes(compiled, tmp_path):
    # lavapipe: its shared MLIR and parameters exist, and its modules compile faster than cpu's
    compiled.get("vulkan-spirv", "lavapipe", "fp32")
    out = compiled.out_dir("vulkan-spirv", "lavapipe", "fp32").parent / "vulkan-killed"
    # a UNet flag no other compile has: its module is not in the module cache, so it compiles
    specs = _specs_copy(tmp_path)
    reg = json.loads((specs / "targets.json").read_text())
    reg["targets"]["vulkan-spirv"]["submodule_flags"]["unet"] = ["--iree-opt-strip-assertions"]
    (specs / "targets.json").write_text(json.dumps(reg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdiree.runtime.cli", "compile", str(compiled.model),
         "--target", "vulkan-spirv", "--arch", "lavapipe", "--dtype", "fp32", "--out", str(out),
         "--specs", str(specs)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 600
    # the text encoder finished: compiled, encoded (its position table), recorded
    while "text_encoder" not in _state(out):
        assert proc.poll() is None, "compile ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the compile and its iree-compile child
    proc.wait()
    assert not (out / "manifest.json").exists()
    import iree.runtime as rt

    for vmfb in out.glob("*.vmfb"):  # anything under a real name is whole (partials are temps)
        if not vmfb.name.startswith("."):
            rt.VmModule.mmap(rt.VmInstance(), str(vmfb))

    ran, log = recompile(compiled.model, out, specs, target="vulkan-spirv", arch="lavapipe")
    assert ("compile", "text_encoder") not in ran  # finished work is kept
    assert ("compile", "unet") in ran
    assert not [p for p in out.iterdir() if ".tmp" in p.name], "stale temp files left behind"
    check_files(load_manifest(out))


class _Stopped(Exception):
    pass


def test_a_compile_stopped_while_learning_a_layout_resumes_there(compiled, tmp_path, monkeypatch):
    """The build state is written before the layout stage: SDXL's UNet compiles for ~15 min and
    its layout takes ~5, so a stop there must not cost the compile again."""
    from llvm_cpu import host_fp32_splits

    compiled.get("cpu", "host", "fp32")  # the shared exports and archives exist
    out = tmp_path / "cpu-stopped"
    learn = encoded_stage.learn_layout
    # on an AMX CPU the UNet learns no layout (bf16x3 parts): the text encoder's is stopped
    stopped = "text_encoder" if host_fp32_splits() else "unet"

    def stop_there(b, submodule, *args):
        if submodule == stopped:
            raise _Stopped
        return learn(b, submodule, *args)

    monkeypatch.setattr(encoded_stage, "learn_layout", stop_there)
    with pytest.raises(_Stopped):
        recompile(compiled.model, out)
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(encoded_stage, "learn_layout", learn)
    ran, _ = recompile(compiled.model, out)
    assert ("layout", stopped) in ran
    assert not {("compile", stopped), ("encode", stopped)} & ran
    assert (out / f"{stopped}.layout.json").is_file()
    check_files(load_manifest(out))


def test_a_layout_without_the_temp_disk_it_takes_is_left_for_a_later_compile(
    compiled, tmp_path, monkeypatch
):
    """Learning a layout writes coded copies of the encoded weights (SDXL bf16: ~21 GB): with
    less disk free than it takes, compile says so, goes on and makes a working artifact without
    the layout (its archive not pruned), and the next compile with the disk learns it."""
    from llvm_cpu import host_fp32_splits

    compiled.get("cpu", "host", "fp32")  # the shared exports and archives exist
    out = tmp_path / "cpu-short"
    sub = "text_encoder" if host_fp32_splits() else "unet"  # one that learns a layout
    monkeypatch.setattr(repack, "_free_bytes", lambda path: 1 << 20)
    ran, log = recompile(compiled.model, out)
    assert f"{sub}: its layout is not learned now: that takes ~" in log
    assert "0.0 GiB free there" in log
    assert not list(out.glob("*.layout.json")) and not {s for s, _ in ran} & {"layout", "prune"}
    m = load_manifest(out)
    check_files(m)
    assert m.submodules[sub].encoder.layout is None
    monkeypatch.undo()
    ran, _ = recompile(compiled.model, out)
    assert ("layout", sub) in ran and not {("compile", sub), ("encode", sub)} & ran
    assert (out / f"{sub}.layout.json").is_file()
    check_files(load_manifest(out))


def test_sdxl_recompile_is_a_noop_and_a_flag_change_recompiles_only_its_submodule(
    compiled_sdxl, tmp_path
):
    base = compiled_sdxl.get("cpu", "host", "fp32")
    ran, log = recompile(compiled_sdxl.model, base)
    assert "up to date" in log and ran <= {("hash", "model")}
    out = base.parent / "cpu-sdxl-flag-change"
    shutil.copytree(base, out)
    _flag_change_recompiles_only(
        compiled_sdxl.model, out, tmp_path, "text_encoder_2", "text_encoder"
    )
    assert load_manifest(out).family == load_manifest(base).family == "sdxl"


def test_a_layout_an_older_learner_left_incomplete_is_learned_again(tmp_path):
    """A recompile keeps a complete layout and one this learner tried, and learns again one an
    older learner left incomplete (every bf16 artifact's before the learner read bf16 packs)."""
    from sdiree.compile.encoded_stage import layout_tried
    from sdiree.runtime.weights.layout import LEARNER_VERSION, Layout

    Layout(complete=True, learner=1).save(tmp_path / "done.json")
    Layout(complete=False, unverified={"w"}, learner=1).save(tmp_path / "partial.json")
    Layout(complete=False, unverified={"w"}).save(tmp_path / "given-up.json")

    def tried(**encoder) -> bool:
        return layout_tried({"encoder": encoder}, tmp_path)

    assert tried(layout_tried=True, layout="done.json")  # an older learner's, complete
    assert not tried(layout_tried=True, layout="partial.json")  # an older learner's, incomplete
    assert tried(layout_tried=True, layout="given-up.json")  # this one's (budget)
    assert Layout.load(tmp_path / "given-up.json").learner == LEARNER_VERSION
    assert tried(layout_tried=True)  # none could be learned (fp16)
    assert not tried(layout="missing.json") and not tried()
