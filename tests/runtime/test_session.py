"""Session: a lost device is retried once on a fresh device, then reported in one line."""

from __future__ import annotations

import numpy as np
import pytest

from sdiree.runtime import generate, session
from sdiree.runtime.errors import UserError
from sdiree.runtime.manifest import load_manifest

LOST = (
    "Error creating vm context with modules: c/runtime/src/iree/hal/drivers/vulkan/queue.c:6000: "
    "DATA_LOSS; [vkWaitSemaphores] VK_ERROR_DEVICE_LOST; while invoking native function "
    "hal.fence.await"
)


@pytest.fixture(scope="module")
def cpu_art(compiled):
    return compiled.get("cpu", "host", "fp32")


def failing_session(monkeypatch, failures: int, message: str = LOST) -> list:
    """Make the first `failures` Session() calls raise `message`; returns the opened sessions."""
    real = session.Session
    opened = []

    def fake(*args, **kwargs):
        if len(opened) < failures:
            opened.append(None)
            raise RuntimeError(message)
        s = real(*args, **kwargs)
        opened.append(s)
        return s

    monkeypatch.setattr(session, "Session", fake)
    return opened


def test_lost_device_is_retried_on_a_fresh_one(cpu_art, tmp_path, monkeypatch, capsys):
    opened = failing_session(monkeypatch, failures=1)
    out = tmp_path / "img.png"
    paths = generate.generate_to_files(
        artifact_dir=cpu_art, prompt="a cat", steps=2, seed=1, output=out
    )
    assert paths == [out] and out.is_file()
    assert len(opened) == 2 and opened[1] is not None
    err = capsys.readouterr().err
    assert "warning: the local-task device was lost" in err and "retrying once" in err


def test_second_loss_is_one_clear_error(cpu_art, tmp_path, monkeypatch):
    failing_session(monkeypatch, failures=2)
    out = tmp_path / "img.png"
    with pytest.raises(UserError, match="was lost twice") as info:
        generate.generate_to_files(artifact_dir=cpu_art, prompt="a cat", steps=2, output=out)
    assert "\n" not in str(info.value) and "--device" in str(info.value)
    assert not out.exists()


@pytest.mark.parametrize(
    "message", [LOST, "DATA_LOSS; while invoking native function hal.fence.await"]
)
def test_a_loss_while_loading_is_retried_inside_the_session(cpu_art, monkeypatch, message):
    """A device lost while the context loads parameters (lavapipe, rarely; the fence await
    may report it as a bare DATA_LOSS) costs one more load on a fresh device, not the caller's
    retry; a second loss there goes to the caller."""
    import iree.runtime as rt

    from sdiree.runtime.device import list_devices

    real, made = rt.VmContext, []

    def flaky(*args, failures=1, **kwargs):
        made.append(None)
        if len(made) <= failures:
            raise RuntimeError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(rt, "VmContext", flaky)
    manifest, info = load_manifest(cpu_art), list_devices("local-task")[0]
    s = session.Session(manifest, info, iter(["text_encoder"]))
    assert len(made) == 2 and s.context is not None
    args = [np.zeros(d.shape, d.dtype) for d in s.decl("text_encoder", "encode").inputs]
    assert all(np.isfinite(o).all() for o in s.call("text_encoder", "encode", *args))
    made.clear()
    monkeypatch.setattr(rt, "VmContext", lambda *a, **k: flaky(*a, failures=2, **k))
    with pytest.raises(RuntimeError, match="DATA_LOSS"):
        session.Session(manifest, info, ["text_encoder"])
    assert len(made) == 2


def test_other_errors_are_not_retried(cpu_art, monkeypatch):
    opened = failing_session(monkeypatch, failures=1, message="RESOURCE_EXHAUSTED; out of memory")
    manifest = load_manifest(cpu_art)
    info = generate.choose_device(manifest, None)[0]
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        session.with_fresh_device_on_loss(manifest, info, ["text_encoder"], lambda s: s, print)
    assert len(opened) == 1


def test_schema_1_manifest_still_loads(compiled, tmp_path):
    """A version-1 manifest (before extra_parameters) is read; its submodules load only their
    one archive. Here: the vulkan artifact relabelled as v1 and its UNet, which has no extra
    archive (its other modules load encoded ones, which v1 did not have)."""
    import json
    import shutil

    src = compiled.get("vulkan-spirv", "lavapipe", "fp32")
    art = tmp_path / src.parent.name / src.name
    shutil.copytree(src, art)
    (art.parent / "params").symlink_to(src.parent / "params")
    data = json.loads((art / "manifest.json").read_text())
    data["schema_version"] = 1
    assert data["submodules"]["unet"]["extra_parameters"] == []
    for sub in data["submodules"].values():
        sub.pop("extra_parameters")
        sub.pop("encoder", None)
    (art / "manifest.json").write_text(json.dumps(data))
    m = load_manifest(art)
    assert all(s.archives() == [(s.parameters, s.scope)] for s in m.submodules.values())
    from sdiree.runtime.device import list_devices

    s = session.Session(m, list_devices("vulkan")[0], ["unet"])
    assert ("unet", "denoise_cfg") in s._functions


def test_cpu_unet_loads_its_model_weights_and_its_encoded_weights(cpu_art):
    """The Winograd weights derived at export reach the module only through its encoded
    archive, so the artifact does not list their archive, unless the UNet's linears are
    panels (a CPU without avx512f), which the module reads from it as they were derived, or
    some of those weights are read in place (llvm_cpu.unet_winograd_read_in_place): then the
    archive is listed, holding those only."""
    import iree.runtime as rt
    from llvm_cpu import host_unet_takes_panels, unet_winograd_read_in_place

    m = load_manifest(cpu_art)
    archives = m.submodules["unet"].archives()
    in_place = unet_winograd_read_in_place(m)
    if host_unet_takes_panels():
        assert archives == [
            ("unet.irpa", "unet"), ("unet.winograd2+panels.irpa", "unet"),
            ("unet.encoded.irpa", "unet_encoded"),
        ]  # fmt: skip
    elif in_place:
        assert archives == [
            ("unet.irpa", "unet"), ("unet.winograd2.irpa", "unet"),
            ("unet.encoded.irpa", "unet_encoded"),
        ]  # fmt: skip
        index = rt.ParameterIndex()
        index.load(str(cpu_art / "unet.winograd2.irpa"))
        assert {k for k, _ in index.items()} == in_place
    else:
        assert [s for _, s in archives] == ["unet", "unet_encoded"]
        assert not any("winograd" in p for p, _ in archives)


STAGING = (
    "Error creating vm context with modules: c/runtime/src/iree/hal/drivers/vulkan/buffer.c:303: "
    "FAILED_PRECONDITION; transient buffer has no staged Vulkan backing; ensure the buffer was "
    "returned from queue_alloca before submitting dependent work; while invoking native "
    "function io_parameters.load; while calling import;"
)


def test_a_parameter_load_without_staging_is_retried(cpu_art, tmp_path, monkeypatch, capsys):
    """iree's Vulkan driver failed so once in 8 SD 1.5-size opens with --weights on lavapipe."""
    opened = failing_session(monkeypatch, failures=1, message=STAGING)
    out = tmp_path / "img.png"
    generate.generate_to_files(artifact_dir=cpu_art, prompt="a cat", steps=2, seed=1, output=out)
    assert out.is_file() and len(opened) == 2
    assert "retrying once" in capsys.readouterr().err
    assert not session.is_device_lost(RuntimeError("FAILED_PRECONDITION; something else"))


def test_a_bare_data_loss_while_loading_parameters_is_a_loss_on_gpus_only():
    """lavapipe, once in a CI run beside a full-size compile; on cpu the same words mean the
    archive itself is bad, which a fresh device would not mend."""
    lost = RuntimeError(
        "Error creating vm context with modules: DATA_LOSS; while invoking native function "
        "io_parameters.load; while calling import; [ 0] bytecode unet@6:175968 -"
    )
    assert session.is_device_lost(lost, gpu=True)
    assert not session.is_device_lost(lost)
    assert not session.is_device_lost(RuntimeError("DATA_LOSS; something else"), gpu=True)


def test_vulkan_sessions_share_one_device_until_a_fresh_one_is_asked(compiled, monkeypatch):
    """A Vulkan device lives as long as the process (lavapipe's teardown crashed CI runs), shared
    by its sessions; a loss's retry and a failed load take a new one."""
    import iree.runtime as rt

    from sdiree.runtime.device import list_devices

    manifest = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    info = list_devices("vulkan")[0]
    a = session.Session(manifest, info, ["text_encoder"])
    b = session.Session(manifest, info, ["text_encoder"])
    assert a.device is b.device
    c = session.Session(manifest, info, ["text_encoder"], fresh_device=True)
    assert c.device is not a.device
    assert session.Session(manifest, info, ["text_encoder"]).device is c.device

    def bad(*args, **kwargs):
        raise RuntimeError("INVALID_ARGUMENT; no parameter found")

    monkeypatch.setattr(rt, "VmContext", bad)
    with pytest.raises(RuntimeError, match="no parameter"):
        session.Session(manifest, info, ["text_encoder"])
    monkeypatch.undo()
    d = session.Session(manifest, info, ["text_encoder"])
    assert d.device is not c.device
    args = [np.zeros(x.shape, x.dtype) for x in d.decl("text_encoder", "encode").inputs]
    want = a.call("text_encoder", "encode", *args)
    for got, ref in zip(d.call("text_encoder", "encode", *args), want, strict=True):
        np.testing.assert_array_equal(got, ref)


def test_a_vulkan_call_runs_with_the_devices_pollers_at_normal_priority(compiled, monkeypatch):
    """runtime/device_pollers.py: lavapipe's polling completion threads, idle between calls, are
    at the normal policy while a session's call runs on the device (and while it loads)."""
    import os

    from sdiree.runtime import device_pollers
    from sdiree.runtime.device import list_devices

    manifest = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    info = next(d for d in list_devices("vulkan") if d.is_cpu_emulation)
    s = session.Session(manifest, info, ["text_encoder"], fresh_device=True)
    pollers = device_pollers._BY_DEVICE[id(s.device)]
    assert pollers.tids
    seen = []
    invoke = s._functions[("text_encoder", "encode")]

    def watched(*args):
        seen.append({os.sched_getscheduler(t) for t in pollers.tids})
        return invoke(*args)

    s._functions[("text_encoder", "encode")] = watched
    args = [np.zeros(x.shape, x.dtype) for x in s.decl("text_encoder", "encode").inputs]
    s.call("text_encoder", "encode", *args)
    assert seen == [{os.SCHED_OTHER}]
    assert {os.sched_getscheduler(t) for t in pollers.tids} == {os.SCHED_IDLE}
