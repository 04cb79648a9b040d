"""The Vulkan GPU presets' fp16 code path, SIMT on every GPU: what each configures and that
its numbers hold.

No vulkan-spirv preset uses cooperative matrices: iree 3.13 writes them with f32 operand
matrices no driver offers (tests/specs/test_vulkan_cooperative_matrix.py). The NVIDIA presets
(ampere, ada) and rdna3 are iree's targets with an empty `mma` list, so every contraction takes
a SIMT pipeline; their UNet carries the SIMT attention spec (tests/specs/test_vulkan_simt_spec.py),
shown here on the tiny model to take exactly attention's P.V. lavapipe given such a preset's
target description configures every contraction as that preset does and runs that path's
fp16 numerics for real against diffusers fp32.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from compile_queue import Queued  # noqa: E402
from configured import configurations, dump_configurations  # noqa: E402
from parity import diffusers_images, psnr  # noqa: E402

MARKER = "__tuning_spec_applied__"
SIMT_REL = "tuning/vulkan_simt_attention.mlir"
PROMPT = "a lighthouse at dusk, oil painting"


def specs_copy(tmp_path: Path, arch: str, dump: Path, target_of: str | None = None) -> Path:
    """The shipped specs with arch's compiles writing their executables' configurations
    (iree-compile's own record of what applied) to dump. target_of: arch takes that preset's
    target description, its subgroup operations off, its export choices and its tuning specs
    (lavapipe running another preset's code path)."""
    folder = tmp_path / f"specs-{arch}-{target_of}"
    shutil.copytree(ROOT / "specs", folder)
    data = json.loads((folder / "targets.json").read_text())
    presets = data["targets"]["vulkan-spirv"]["arches"]
    preset = presets[arch]
    if target_of is not None:
        (target,) = presets[target_of]["flags"]
        assert "subgroup = shuffle|arithmetic" in target, "the preset's subgroup ops moved"
        preset["flags"] = [target.replace("subgroup = shuffle|arithmetic", "subgroup = none")]
        preset["export"] = presets[target_of].get("export", {})
        preset["tuning_specs"] = presets[target_of].get("tuning_specs", {})
    preset["flags"] = [*preset["flags"], f"--iree-hal-dump-executable-configurations-to={dump}"]
    (folder / "targets.json").write_text(json.dumps(data))
    return folder


# What each test needs compiled (a partial artifact, as `sdiree compile --submodules` makes):
# the spec's ops are in the UNet and the VAE decoder; an image needs the text encoder too.
TUNED = ("unet", "vae_decoder")
TEXT_TO_IMAGE = ("text_encoder", *TUNED)


def tiny_options(model: Path, arch: str, specs: Path, out: Path, submodules=TUNED) -> dict:
    """CompileOptions' fields of the tiny model's vulkan-spirv fp16 build for arch."""
    return dict(
        model_dir=model, target="vulkan-spirv", arch=arch, dtype="fp16", out=out,
        specs_dir=specs, submodules=submodules,
    )  # fmt: skip


def pipeline(text: str) -> str:
    return re.search(r"spirv_pipeline<(\w+)>", text).group(1)


def tuned(configs: dict[str, str]) -> dict[str, str]:
    return {n: t for n, t in configs.items() if MARKER in t}


def image_and_reference(model: Path, art: Path, tmp_path: Path, steps: int = 4):
    """The artifact's fp16 image (euler, seed 42) and diffusers fp32's on the same weights."""
    from PIL import Image

    from sdiree.runtime.generate import generate_to_files

    png = tmp_path / "img.png"
    generate_to_files(
        artifact_dir=art, prompt=PROMPT, negative_prompt="", steps=steps, guidance_scale=7.5,
        scheduler="euler", seed=42, num_images=1, output=png,
    )  # fmt: skip
    with Image.open(png) as im:
        ours = np.asarray(im.convert("RGB"))[None]
    ref = diffusers_images(model, "euler", steps, 7.5, 42, PROMPT, "", 1, ours.shape[1:3])
    return ours, ref


def choices(text: str) -> tuple:
    """An executable's configuration as iree chose it: its translation info (pipeline,
    workgroup size) and lowering configs (tiles), without the target it was chosen for."""
    return (
        re.findall(r"translation_info = (#iree_codegen\.translation_info<.*?>)\}", text),
        re.findall(r"lowering_config = (#iree_codegen\.lowering_config<[^>]*>)", text),
    )


def gpu_build(arch: str) -> Queued:
    """The tiny model's UNet and VAE decoder compiled for arch fp16, its executables'
    configurations dumped (queued for the background at the session's start)."""

    def prepare(root: Path, model: Path) -> dict:
        return tiny_options(model, arch, specs_copy(root, arch, root / "dump"), root / arch)

    return Queued(f"{arch}-fp16", prepare)


def lavapipe_as(arch: str) -> Queued:
    """The tiny model's text-to-image submodules compiled for lavapipe with arch's target
    description (specs_copy's target_of), configurations dumped."""

    def prepare(root: Path, model: Path) -> dict:
        specs = specs_copy(root, "lavapipe", root / "dump", target_of=arch)
        return tiny_options(model, "lavapipe", specs, root / f"lavapipe-as-{arch}", TEXT_TO_IMAGE)

    return Queued(f"lavapipe-as-{arch}-fp16", prepare)


GPU_BUILDS = {arch: gpu_build(arch) for arch in ("ampere", "rdna3")}
LAVAPIPE_AS = {arch: lavapipe_as(arch) for arch in ("ampere", "rdna3")}


def built(job: Queued, model: Path, tmp_path_factory) -> tuple[Path, Path]:
    """(artifact, configurations dump) of a queued build."""
    root, _ = job.result(model, tmp_path_factory)
    return Path(job.fields["out"]), root / "dump"


@pytest.fixture(scope="module")
def ampere_build(tiny_model, tmp_path_factory):
    return built(GPU_BUILDS["ampere"], tiny_model, tmp_path_factory)


@pytest.fixture(scope="module")
def rdna3_build(tiny_model, tmp_path_factory):
    return built(GPU_BUILDS["rdna3"], tiny_model, tmp_path_factory)


@pytest.mark.parametrize("arch", ["ampere", "rdna3"])
def test_gpu_presets_compile_fp16_without_cooperative_matrices(arch, request):
    """ampere's and rdna3's fp16 builds: every contraction on a SIMT pipeline (ampere's within
    the 48 KiB of shared memory NVIDIA's Vulkan driver offers); the UNet with the SIMT attention
    spec (tests/specs/test_vulkan_simt_spec.py), the VAE with none."""
    from sdiree.runtime.targets import load_registry

    vk = load_registry().target("vulkan-spirv")
    for name in ("ampere", "ada", "rdna3"):
        flags = " ".join(vk.arches[name].flags)
        assert "mma = []" in flags, name
        assert ("max_workgroup_memory_bytes = 49152" in flags) == (name != "rdna3"), name
        assert vk.arches[name].tuning_specs == {"unet": SIMT_REL}, name
    art, dump = request.getfixturevalue(f"{arch}_build")
    configs = configurations(dump)
    pipelines = {pipeline(t) for t in configs.values()}
    assert "MatmulPromoteVectorize" in pipelines and "CooperativeMatrixVectorize" not in pipelines
    assert tuned(configs) and not any(n.startswith("decode") for n in tuned(configs))
    manifest = json.loads((art / "manifest.json").read_text())
    specs = {name: list(sub["tuning_specs"]) for name, sub in manifest["submodules"].items()}
    assert specs == {"unet": [SIMT_REL], "vae_decoder": []}
    assert "cooperative_matrix" not in manifest["target"]["device_requires"]


def test_nvidia_simt_spec_takes_exactly_attentions_pv(ampere_build, tmp_path):
    """The ops the SIMT attention spec was written for, in the tiny ampere UNet: the attention
    P.V batch matmuls whose head dim (N) is a multiple of 8 and not of 16 and whose keys (K)
    are a multiple of 8 (self-attention at the 16x16 level; cross-attention's 77 keys keep
    iree's choice, as does the 8x8 level's head dim of 4). Each carries the spec's marker and
    the tiled SIMT pipeline; the same UNet configured without the spec configures them
    otherwise (SD 1.5's on SubgroupReduce: tests/specs/test_vulkan_simt_spec.py) and every
    other dispatch exactly as with it."""
    art, dump = ampere_build
    configs = configurations(dump)
    plain = dump_configurations(art, "unet", tmp_path / "plain", specs=False)
    default = {n: t for n, t in configurations(plain).items() if n.startswith("denoise")}
    unet = {n: t for n, t in configs.items() if n.startswith("denoise")}
    assert set(default) == set(unet)

    def is_pv(name: str) -> bool:
        m = re.search(r"batch_matmul_\d+x(\d+)x(\d+)x(\d+)_f16xf16xf32$", name)
        n, k = (int(m.group(2)), int(m.group(3))) if m else (0, 0)
        return bool(m) and n % 8 == 0 and n % 16 != 0 and k % 8 == 0

    matched = set(tuned(unet))
    assert matched and matched == {n for n in unet if is_pv(n)}
    for name, text in unet.items():
        if name in matched:
            assert pipeline(text) == "MatmulPromoteVectorize", name
            assert choices(text) != choices(default[name]), name
        else:
            assert choices(text) == choices(default[name]), name


@pytest.mark.parametrize("arch", ["ampere", "rdna3"])
def test_lavapipe_runs_the_gpu_presets_choices_and_matches_diffusers(
    tiny_model, arch, request, tmp_path, tmp_path_factory
):
    """The GPU presets' fp16 code path in numbers: lavapipe given ampere's (arch sm_80, 48 KiB
    of shared memory) or rdna3's target description, no cooperative matrices either way, with
    its subgroup operations off (lavapipe's subgroups are 8 wide; the presets' reductions are
    written for 32 or 64) configures every contraction exactly as that preset's build does, the
    SIMT matmul pipeline's tiles included; only subgroup-reduction dispatches differ. That
    build runs, and its fp16 image matches diffusers fp32."""
    art, dump = built(LAVAPIPE_AS[arch], tiny_model, tmp_path_factory)
    ours_cfg = configurations(dump)
    theirs = configurations(request.getfixturevalue(f"{arch}_build")[1])
    assert set(theirs) <= set(ours_cfg)
    promoted = 0
    for name, text in theirs.items():
        if pipeline(text) == "SubgroupReduce":
            assert pipeline(ours_cfg[name]) != "SubgroupReduce", name
            continue
        assert choices(ours_cfg[name]) == choices(text), name
        promoted += pipeline(text) == "MatmulPromoteVectorize"
    assert promoted >= 10  # the contractions the GPU runs on the SIMT matmul pipeline

    ours, ref = image_and_reference(tiny_model, art, tmp_path)
    assert psnr(ours, ref) >= 30.0
