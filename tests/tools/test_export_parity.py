"""tools/export_parity.py exports a model's submodules in one trace and in two and compares
iree-compile's input; a refused (target, arch, dtype) is said and skipped."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import export_parity  # noqa: E402  (tools/ is on sys.path: tests/conftest.py)


def test_every_export_of_a_vulkan_build_is_the_same_either_way(tiny_model, capsys):
    combos = "vulkan-spirv:baseline:fp16,vulkan-spirv:baseline:fp32"
    assert export_parity.main([str(tiny_model), "--combos", combos]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("refused tiny-sd vulkan-spirv:baseline:fp16") for line in lines)
    same = [line for line in lines if line.startswith("SAME ")]
    subs = ("text_encoder", "unet", "vae_decoder", "vae_encoder")
    assert sorted(line.split()[3].rstrip(":") for line in same) == sorted(subs)
    assert not any(line.startswith("DIFF") for line in lines)
