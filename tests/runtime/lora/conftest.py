"""Fixtures of the LoRA tests: a tiny model's weights, LoRA files for it, and both merges to
compare: sdiree's (numpy, runtime/lora) and diffusers' (`load_lora_weights` + `fuse_lora`).

`sd1` and `sd2` are `TinyModel`s of the session's tiny SD 1.x and SD 2.x models; the fixtures
`model_shapes`, `base_weights`, `make_lora`, `sdiree_merge`, `diffusers_merge` and
`assert_same_merge` are the SD 1.x model's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sdiree.runtime.lora import plan_loras

COMPONENTS = ("unet", "text_encoder")


class TinyModel:
    def __init__(self, path: Path, lora_dir: Path):
        from make_tiny_lora import COMPONENT_FILES, model_shapes
        from safetensors.numpy import load_file

        self.path = Path(path)
        self.shapes = model_shapes(path)
        self.base = {c: load_file(self.path / rel) for c, rel in COMPONENT_FILES.items()}
        self._lora_dir = lora_dir
        self._made: dict[tuple, Path] = {}

    def make_lora(self, fmt: str, seed: int = 0, **options) -> Path:
        """A random LoRA for the model (tools/make_tiny_lora.py), made once per arguments."""
        from make_tiny_lora import make_tiny_lora

        key = (fmt, seed, tuple(sorted(options.items())))
        if key not in self._made:
            out = self._lora_dir / f"{fmt}-{seed}-{len(self._made)}.safetensors"
            self._made[key] = make_tiny_lora(self.path, out, fmt, seed, **options)
        return self._made[key]

    def sdiree_merge(self, loras):
        """[(path, strength), ...] -> (plan, {component: {key: merged}}) for the keys the
        plan changes."""
        from make_tiny_lora import read_lora

        specs = [(Path(p).stem, *read_lora(p), s) for p, s in loras]
        plan = plan_loras(specs, self.shapes)
        merged = {
            c: {k: plan.merged(c, k, self.base[c][k]) for k in plan.keys(c)}
            for c in plan.components
        }
        return plan, merged

    def diffusers_merge(self, loras, **load_kwargs):
        """[(path, scale), ...] -> {component: state dict} after diffusers loads the files as
        adapters, weights them with set_adapters and fuses them."""
        torch = pytest.importorskip("torch")
        pytest.importorskip("peft")
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(self.path, dtype=torch.float32)
        names = [f"lora{i}" for i in range(len(loras))]
        for name, (path, _) in zip(names, loras, strict=True):
            pipe.load_lora_weights(str(path), adapter_name=name, **load_kwargs)
        pipe.set_adapters(names, adapter_weights=[s for _, s in loras])
        pipe.fuse_lora(components=list(COMPONENTS), lora_scale=1.0, adapter_names=names)
        pipe.unload_lora_weights()
        return {
            c: {k: v.detach().numpy() for k, v in getattr(pipe, c).state_dict().items()}
            for c in COMPONENTS
        }

    def changed_keys(self, reference) -> dict[str, set[str]]:
        return {
            c: {k for k, v in reference[c].items() if not np.array_equal(v, self.base[c][k])}
            for c in COMPONENTS
        }

    def assert_same_merge(self, plan, merged, reference) -> int:
        """sdiree's merged weights equal the reference's (rtol 1e-5, atol 1e-6) wherever the
        reference changed a weight, and sdiree changes no other; returns how many changed."""
        want = self.changed_keys(reference)
        for c in COMPONENTS:
            assert set(plan.keys(c)) == want[c], c
            for k in want[c]:
                np.testing.assert_allclose(
                    merged[c][k], reference[c][k], rtol=1e-5, atol=1e-6, err_msg=f"{c} {k}"
                )
        return sum(len(v) for v in want.values())


@pytest.fixture(scope="session")
def sd1(tiny_model, tmp_path_factory) -> TinyModel:
    return TinyModel(tiny_model, tmp_path_factory.mktemp("loras-sd1"))


@pytest.fixture(scope="session")
def sd2(tiny_sd2_model, tmp_path_factory) -> TinyModel:
    return TinyModel(tiny_sd2_model, tmp_path_factory.mktemp("loras-sd2"))


@pytest.fixture(scope="session")
def model_shapes(sd1):
    return sd1.shapes


@pytest.fixture(scope="session")
def base_weights(sd1):
    return sd1.base


@pytest.fixture(scope="session")
def make_lora(sd1):
    return sd1.make_lora


@pytest.fixture(scope="session")
def sdiree_merge(sd1):
    return sd1.sdiree_merge


@pytest.fixture(scope="session")
def diffusers_merge(sd1):
    return sd1.diffusers_merge


@pytest.fixture(scope="session")
def assert_same_merge(sd1):
    return sd1.assert_same_merge
