"""The shipped tuning specs: each is what its generator writes, is needed, matches the ops it was
written for (the compiler's own configuration dump shows its marker on them) and changes the
compiled module; and the SIMT choices it makes give fp16 images equal to diffusers' fp32 ones.

vulkan-spirv's spec (tools/make_vulkan_tuning_spec.py) sends the contractions that iree 3.13's
cooperative-matrix codegen fails on to the SIMT matmul pipeline. Checked by cross-compiling the
tiny model for rdna3 fp16, and on lavapipe, which runs an fp16 build that takes the same choices
for those ops. The NVIDIA presets (ampere, ada) use no cooperative matrices at all: NVIDIA's
Vulkan driver refuses every cooperative-matrix shader iree 3.13 writes (an H200, driver 580;
tools/PERFORMANCE.md), so they need no spec, and a test here shows their fp16 builds
hold none; lavapipe given ampere's target description configures every contraction as ampere
does, and runs that path's fp16 numerics for real.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from make_vulkan_tuning_spec import CLASSES, SPEC, render  # noqa: E402
from parity import diffusers_images, psnr  # noqa: E402

MARKER = "__tuning_spec_applied__"
SPEC_REL = "tuning/vulkan_coopmatrix_fallback.mlir"
COOP = {"*": SPEC_REL}
SIMT_REL = "tuning/vulkan_simt_attention.mlir"
PROMPT = "a lighthouse at dusk, oil painting"


def test_shipped_spec_is_the_generators_output():
    assert SPEC.read_text() == render()
    for name in CLASSES:
        assert f"@match_{name}_64_k32" in SPEC.read_text()


def test_registry_gives_the_spec_to_the_cooperative_matrix_arches():
    from sdiree.runtime.targets import load_registry

    vk = load_registry().target("vulkan-spirv")
    assert vk.tuning_spec_via == "module-attribute"
    with_mma = {"rdna3"}
    for name, arch in vk.arches.items():
        assert (arch.tuning_specs == {"*": SPEC_REL}) == (name in with_mma), name
        assert bool(arch.device.get("cooperative_matrix")) == (name in with_mma), name
        assert "fp16" not in arch.refused_dtypes or name == "baseline", name


def specs_copy(
    tmp_path: Path,
    arch: str,
    dump: Path | None,
    specs: dict | None,
    target_of: str | None = None,
) -> Path:
    """The shipped specs with arch's tuning specs set to `specs` (None: as shipped) and, with
    dump, its compiles writing their executables' configurations (iree-compile's own record of
    what applied) to dump. target_of: arch takes that preset's target description, its
    subgroup operations off, its export choices and (with specs None) its tuning specs
    (lavapipe running another preset's code path)."""
    folder = tmp_path / f"specs-{arch}-{specs is not None and bool(specs)}-{target_of}"
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
    if specs is not None:
        preset["tuning_specs"] = specs
    if dump is not None:
        preset["flags"] = [*preset["flags"], f"--iree-hal-dump-executable-configurations-to={dump}"]
    (folder / "targets.json").write_text(json.dumps(data))
    return folder


# What each test needs compiled (a partial artifact, as `sdiree compile --submodules` makes):
# the spec's ops are in the UNet and the VAE decoder; an image needs the text encoder too.
TUNED = ("unet", "vae_decoder")
TEXT_TO_IMAGE = ("text_encoder", *TUNED)


def compile_tiny(model: Path, arch: str, specs: Path, out: Path, submodules=TUNED):
    from sdiree.compile.driver import CompileOptions, compile_model
    from sdiree.compile.report import Reporter

    opts = CompileOptions(
        model, "vulkan-spirv", arch=arch, dtype="fp16", out=out, specs_dir=specs,
        submodules=submodules,
    )  # fmt: skip
    return compile_model(opts, Reporter(stream=io.StringIO()))


def configurations(dump: Path) -> dict[str, str]:
    """{dispatch function name: its configured source} from a configuration dump."""
    out = {}
    for f in dump.glob("*.mlir"):
        text = f.read_text()
        for name in re.findall(r"func\.func @(\S+?)\(", text):
            out[name] = text
    return out


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


def test_cooperative_matrix_arch_needs_the_spec_and_it_applies(tiny_model, tmp_path):
    from sdiree.runtime.errors import UserError

    with pytest.raises(UserError, match="no GPU subgroup mma compute ops generated"):
        compile_tiny(tiny_model, "rdna3", specs_copy(tmp_path, "rdna3", None, {}),
                     tmp_path / "without", submodules=("unet",))  # fmt: skip

    dump = tmp_path / "dump"
    art = tmp_path / "with"
    compile_tiny(tiny_model, "rdna3", specs_copy(tmp_path, "rdna3", dump, COOP), art)
    manifest = json.loads((art / "manifest.json").read_text())
    for sub in manifest["submodules"].values():
        assert list(sub["tuning_specs"]) == [SPEC_REL]
        assert not any("tuning" in f or "transform-dialect" in f for f in sub["flags"])
    configs = configurations(dump)
    matched = tuned(configs)
    # the ops it was written for: the transposed-output 1x1 convolutions and the attention
    # batch matmuls, in the UNet and the VAE; each now on the SIMT pipeline
    assert any("matmul_like" in n for n in matched) and any("batch_matmul" in n for n in matched)
    assert any(n.startswith("decode") for n in matched)
    for name, text in matched.items():
        assert re.search(r"(matmul_like|batch_matmul)\w*_f16xf16xf32$", name), name
        assert pipeline(text) == "MatmulPromoteVectorize", name
    # and nothing else: cooperative matrices stay where they compile
    coop = [n for n, t in configs.items() if pipeline(t) == "CooperativeMatrixVectorize"]
    assert coop and not set(coop) & set(matched)
    assert not any(MARKER in t for n, t in configs.items() if n not in matched)


def choices(text: str) -> tuple:
    """An executable's configuration as iree chose it: its translation info (pipeline,
    workgroup size) and lowering configs (tiles), without the target it was chosen for."""
    return (
        re.findall(r"translation_info = (#iree_codegen\.translation_info<.*?>)\}", text),
        re.findall(r"lowering_config = (#iree_codegen\.lowering_config<[^>]*>)", text),
    )


@pytest.fixture(scope="module")
def ampere_build(tiny_model, tmp_path_factory):
    """The tiny model's UNet and VAE decoder compiled for ampere fp16: (artifact, dump)."""
    tmp = tmp_path_factory.mktemp("ampere")
    dump, art = tmp / "dump", tmp / "ampere"
    compile_tiny(tiny_model, "ampere", specs_copy(tmp, "ampere", dump, None), art)
    return art, dump


def test_nvidia_presets_compile_fp16_without_cooperative_matrices(ampere_build):
    """ampere's fp16 build: every contraction on a SIMT pipeline, within the 48 KiB of shared
    memory NVIDIA's Vulkan driver offers; the UNet with the SIMT attention spec
    (tests/specs/test_vulkan_simt_spec.py), the VAE with none."""
    from sdiree.runtime.targets import load_registry

    vk = load_registry().target("vulkan-spirv")
    for name in ("ampere", "ada"):
        flags = " ".join(vk.arches[name].flags)
        assert "mma = []" in flags and "max_workgroup_memory_bytes = 49152" in flags, name
        assert vk.arches[name].tuning_specs == {"unet": SIMT_REL}, name
    art, dump = ampere_build
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
    import os
    import subprocess

    from sdiree.compile.iree_compile import iree_compile_tool

    art, dump = ampere_build
    configs = configurations(dump)
    sub = json.loads((art / "manifest.json").read_text())["submodules"]["unet"]
    (mlir,) = Path(os.environ["SDIREE_CACHE"]).rglob(sub["mlir"])
    plain = tmp_path / "plain"
    flags = [f for f in sub["flags"] if "dump-executable-configurations" not in f]
    cmd = [
        iree_compile_tool(), str(mlir), *flags, "--compile-to=executable-configurations",
        f"--iree-hal-dump-executable-configurations-to={plain}", "-o", str(tmp_path / "x.mlir"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
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


def test_lavapipe_fp16_with_the_spec_matches_diffusers(tiny_model, tmp_path):
    """lavapipe has no cooperative matrices: its fp16 build with the spec runs the same SIMT
    configurations for the same ops as the rdna3 build, for real, against diffusers fp32."""
    dump = tmp_path / "dump"
    art = tmp_path / "lavapipe-fp16"
    compile_tiny(
        tiny_model, "lavapipe", specs_copy(tmp_path, "lavapipe", dump, COOP), art, TEXT_TO_IMAGE
    )
    matched = tuned(configurations(dump))
    assert any("matmul_like" in n for n in matched) and any("batch_matmul" in n for n in matched)
    assert all(pipeline(t) == "MatmulPromoteVectorize" for t in matched.values())

    ours, ref = image_and_reference(tiny_model, art, tmp_path)
    assert np.isfinite(ours).all()
    assert psnr(ours, ref) >= 30.0


def test_lavapipe_runs_nvidias_simt_choices_and_matches_diffusers(
    tiny_model, ampere_build, tmp_path
):
    """NVIDIA's fp16 code path in numbers: lavapipe given ampere's target description (arch
    sm_80, no cooperative matrices, 48 KiB of shared memory) with its subgroup operations off
    (lavapipe's subgroups are 8 wide; ampere's reductions are written for 32) configures every
    contraction exactly as the ampere build does, the SIMT matmul pipeline's tiles included;
    only ampere's subgroup-reduction dispatches differ. That build runs, and its fp16 image
    matches diffusers fp32."""
    dump = tmp_path / "dump"
    art = tmp_path / "lavapipe-as-ampere"
    specs = specs_copy(tmp_path, "lavapipe", dump, None, target_of="ampere")
    compile_tiny(tiny_model, "lavapipe", specs, art, TEXT_TO_IMAGE)
    ours_cfg = configurations(dump)
    theirs = configurations(ampere_build[1])
    assert set(theirs) <= set(ours_cfg)
    promoted = 0
    for name, text in theirs.items():
        if pipeline(text) == "SubgroupReduce":
            assert pipeline(ours_cfg[name]) != "SubgroupReduce", name
            continue
        assert choices(ours_cfg[name]) == choices(text), name
        promoted += pipeline(text) == "MatmulPromoteVectorize"
    assert promoted >= 10  # the contractions NVIDIA runs on the SIMT matmul pipeline

    ours, ref = image_and_reference(tiny_model, art, tmp_path)
    assert psnr(ours, ref) >= 30.0
