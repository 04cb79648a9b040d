"""tools/make_tiny_sd.py --inpaint: a StableDiffusionInpaintPipeline folder with a 9-channel UNet,
of SD 1.x or SD 2.x, that diffusers loads and sdiree's compile reads as its family's inpainting
model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_inpaint_folder_is_its_familys_inpainting_model(tmp_path, family):
    pytest.importorskip("torch")
    from sdiree.compile.model_source import open_model
    from sdiree.runtime.families import load_families

    out = tmp_path / f"tiny-{family}-inpaint"
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "make_tiny_sd.py"), str(out), "--family", family, "--inpaint"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "inpainting pipeline" in proc.stdout
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionInpaintPipeline"
    model = open_model(out)
    unet = model.config("unet")
    assert (unet["in_channels"], unet["out_channels"]) == (9, 4)
    configs = {c: model.config(c) for c in ("unet", "text_encoder")}
    assert model.family.name == family
    assert load_families().pipeline_for(model.family, configs) == "inpaint"
