"""The tiny SD 2.x model on all four targets: cpu and lavapipe modules match torch (`verify`),
rocm and cuda fp16 (attention upcast through the fused op) compile and load; the manifest
records the family."""

from __future__ import annotations

import pytest

from sdiree.compile.verify import TOLERANCE, check_parity
from sdiree.runtime.families import load_families
from sdiree.runtime.manifest import check_files, load_manifest

SUBMODULES = {"text_encoder", "unet", "vae_decoder", "vae_encoder"}


def sd2_manifest(out, target, dtype):
    m = load_manifest(out)
    check_files(m)
    d = m.data
    assert (m.family, m.pipeline, d["model"]["pipeline_class"]) == (
        "sd2",
        "text2img",
        "StableDiffusionPipeline",
    )
    assert (d["target"]["name"], d["dtype"]) == (target, dtype)
    assert set(m.submodules) == SUBMODULES
    assert d["text_encoders"] == [
        {
            "submodule": "text_encoder",
            "max_length": 77,
            "hidden_size": 32,
            "tokenizer": "tokenizer",
            "pooled": "pooled_output",
            "pooled_at": "largest_id",  # the tiny SD 2.x's config says eos_token_id 2
        }
    ]
    assert (d["image"]["height"], d["image"]["width"]) == (64, 64)
    # the entry functions the family declares (specs/families.json)
    family = load_families().family("sd2")
    for name, sub in m.submodules.items():
        assert list(sub.functions) == family.submodules[name]["functions"], name
    return m


@pytest.mark.parametrize(
    "target,arch,dtype", [("cpu", "host", "fp32"), ("vulkan-spirv", "lavapipe", "fp32")]
)
def test_sd2_modules_match_torch(compiled_sd2, target, arch, dtype):
    out = compiled_sd2.get(target, arch, dtype)
    sd2_manifest(out, target, dtype)
    assert_modules_match_torch(out, dtype, SUBMODULES)


def assert_modules_match_torch(out, dtype: str, submodules: set[str]) -> None:
    """`verify` of every submodule of the artifact at out: within its dtype's tolerance, and
    fp32 ones within 1e-4 of torch."""
    results = check_parity(out)
    assert {r.submodule for r in results} == submodules
    for r in results:
        assert r.tolerance == TOLERANCE[dtype]
        assert r.ok, r.line()
    assert max(r.rel for r in results) <= 1e-4


def assert_gpu_modules_load(m, target: str) -> None:
    """Every module of manifest m holds the target's executable and its entry functions."""
    import iree.runtime as rt

    instance = rt.VmInstance()
    expected_format = {"rocm": b"rocm-hsaco-fb", "cuda": b"cuda-nvptx-fb"}[target]
    for name, sub in m.submodules.items():
        vmfb = m.path(sub.vmfb)
        module = rt.VmModule.mmap(instance, str(vmfb))
        for fn in sub.functions:
            assert module.lookup_function(fn) is not None, (name, fn)
        assert expected_format in vmfb.read_bytes(), f"{name}.vmfb has no {target} executable"


@pytest.mark.parametrize(
    "target,arch,dtype", [("rocm", "gfx942", "fp16"), ("cuda", "sm_80", "fp16")]
)
def test_sd2_gpu_targets_compile_and_load(compiled_sd2, target, arch, dtype):
    m = sd2_manifest(compiled_sd2.get(target, arch, dtype), target, dtype)
    assert m.data["target"]["export"]["attention"] == "sdpa"  # upcast layers: fp32 fused op
    assert_gpu_modules_load(m, target)
