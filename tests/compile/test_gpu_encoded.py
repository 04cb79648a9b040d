"""GPU modules compute nothing from their weights at load; what is left is precomputed on the CPU.

IREE hoists what a module computes from its weights alone into its initializer. On the GPU
targets that was a transposed copy of nearly every linear weight for the batch-1 functions
(the UNet's unguided `denoise`, the text encoders): both copies held in device memory and, at
SDXL size, 4.4 GB of copies in one device allocation, above the 4 GiB per allocation that AMD's
and Intel's Vulkan drivers allow. The GPU targets now export linears as 2-D matmuls
(`linear: "flat"`, compile/exporters/linear_flat.py), so the UNet and VAE modules have no such
work (the VAE keeps native linears: four small copies); what is left is split into an encoder module compiled
for the host CPU (targets.json `encoder`: no GPU needed to compile, and a moved artifact
re-encodes `--weights` on any CPU of its kind), run once by compile, and any such output is
loaded in parameters of at most 1 GiB on Vulkan (`--iree-stream-resource-max-allocation-size`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdiree.compile.param_encoder import loads_with
from sdiree.runtime.manifest import load_manifest
from sdiree.runtime.weights.pages import entry_views

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from compile_queue import Queued  # noqa: E402

CAP_FLAG = "--iree-stream-resource-max-allocation-size="
GPU_BUILDS = (
    ("vulkan-spirv", "lavapipe", "fp32"),
    ("vulkan-spirv", "lavapipe", "fp16"),
    ("rocm", "gfx942", "fp16"),
    ("cuda", "sm_80", "fp16"),
)
# fp16 VAE modules that compile their convs channels-last from hoisted (encoded) filter transposes
NHWC_VAES = {("cuda", "vae_decoder"), ("rocm", "vae_decoder"), ("rocm", "vae_encoder")}


@pytest.mark.parametrize("target,arch,dtype", GPU_BUILDS)
def test_gpu_modules_make_no_copies_of_their_weights_at_load(compiled, target, arch, dtype):
    """iree-compile splits out an encoder wherever a module computes anything from its weights
    at load: the UNet has none; the text encoder's (its position table) runs on the host CPU
    and its output is loaded beside the weights. The VAE keeps native linears (flat, its
    512-wide attention matmul needs 84 KiB of shared memory on ampere, limit 48): on vulkan
    its four attention weights may come as precomputed copies (vulkan, cuda: 2 MB at SD 1.5
    size), a small share of its weights."""
    m = load_manifest(compiled.get(target, arch, dtype))
    encoded = {name for name, sub in m.submodules.items() if sub.encoder is not None}
    assert "text_encoder" in encoded and "unet" not in encoded
    for name in encoded - {"text_encoder"}:
        assert name in ("vae_decoder", "vae_encoder"), name
        if dtype == "fp16" and (target, name) in NHWC_VAES:
            continue  # its NHWC filters: test_convs_channels_last_on_one_copy_of_each_filter
        sub = m.submodules[name]
        copies = m.path(sub.extra_parameters[0][0]).stat().st_size
        assert copies < 0.05 * m.path(sub.parameters).stat().st_size, name
    sub = m.submodules["text_encoder"]
    assert sub.encoder.driver == "local-task"
    assert sub.extra_parameters == (("text_encoder.encoded.irpa", "text_encoder_encoded"),)
    assert m.path(sub.encoder.vmfb).is_file()
    assert m.data["schema_version"] == 6


def _names(vmfb: bytes, key: str) -> bool:
    """Whether a module names parameter key (its keys lie back to back in the module's string
    table: `<conv>.weight` is also the start of `<conv>.weight_fhwc`, which does not count)."""
    import re

    return re.search(re.escape(key.encode()) + rb"(?!_fhwc)", vmfb) is not None


def _filters(m, sub) -> dict:
    """{key: entry} of the 4-D weights in submodule sub's own archive (the VAE's is shared: the
    encoder's are `encoder.` and `quant_conv.`, the decoder's the rest)."""
    from sdiree.runtime.weights.archive import Archive

    entries = Archive(m.path(m.submodules[sub].parameters)).entries
    encoder = sub == "vae_encoder"
    return {k: e for k, e in entries.items() if e.shape and len(e.shape) == 4
            and k.startswith(("encoder.", "quant_conv.")) == encoder}  # fmt: skip


@pytest.mark.parametrize("target,arch", [("cuda", "sm_80"), ("rocm", "gfx942")])
def test_convs_channels_last_on_one_copy_of_each_filter(compiled, target, arch):
    """cuda and rocm fp16 compile the UNet's and the VAE decoder's convolutions channels-last
    (iree's transpose-convolution pipeline: on an H200 the UNet call x0.82, the decode x0.73;
    AMD's own SDXL builds take it too). The device holds one copy of each filter,
    channels-last, and none of the originals:
    - the UNet's filters are exported channels-last (`pointwise_einsum_fhwc`: an archive of
      them beside the model's, loaded in its scope), so nothing is hoisted and its two functions
      share them (hoisted, each function loaded its own transposed copy: +1 GB at SD 1.5 size);
    - the VAE decoder has one function: its hoisted transposes are precomputed by the encoder
      (rocm's VAE encoder too: its 512-to-8-channel conv_out overflows gfx942's shared memory
      as an NCHW implicit GEMM).
    No module names an original filter of a conv larger than 1x1."""
    from sdiree.runtime.weights.archive import Archive

    m = load_manifest(compiled.get(target, arch, "fp16"))
    vaes = [sub for sub in ("vae_decoder", "vae_encoder") if (target, sub) in NHWC_VAES]
    for sub in ("unet", *vaes):
        assert any("transpose-convolution" in f for f in m.data["submodules"][sub]["flags"]), sub

    unet = m.submodules["unet"]
    assert unet.encoder is None and m.data["submodules"]["unet"]["export"]["conv"] == (
        "pointwise_einsum_fhwc"
    )
    assert unet.extra_parameters == (("unet.fhwc.irpa", "unet"),)
    named = m.path(unet.vmfb).read_bytes()
    filters = _filters(m, "unet")
    wide = {k for k, e in filters.items() if e.shape[2:] != (1, 1)}
    assert wide and not any(_names(named, k) for k in wide)
    fhwc = Archive(m.path("unet.fhwc.irpa"))
    assert set(fhwc.entries) == {k + "_fhwc" for k in wide}
    assert all(_names(named, k + "_fhwc") for k in wide)
    own = Archive(m.path(unet.parameters))
    for k in wide:
        want = np.ascontiguousarray(own.array(k).transpose(0, 2, 3, 1))
        np.testing.assert_array_equal(fhwc.array(k + "_fhwc"), want)

    for sub in vaes:
        vae = m.submodules[sub]
        named = m.path(vae.vmfb).read_bytes()
        filters = _filters(m, sub)
        three = {k for k, e in filters.items() if e.shape[2:] == (3, 3)}
        assert three and not any(_names(named, k) for k in three), sub
        assert all(_names(named, k) for k, e in filters.items() if e.shape[2:] == (1, 1)), sub
        size = sum(filters[k].length for k in three)
        copies = m.path(vae.extra_parameters[0][0]).stat().st_size
        assert size <= copies < 1.2 * size + 65536, sub


def test_vulkan_text_encoder_loads_the_encoded_weights(compiled):
    """The lavapipe module needs its encoded archive: it no longer computes it at load."""
    m = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    te = m.submodules["text_encoder"]
    vmfb, own = m.path(te.vmfb), ("text_encoder", m.path(te.parameters))
    encoded = ("text_encoder_encoded", m.path(te.extra_parameters[0][0]))
    assert loads_with(vmfb, [own, encoded], "vulkan")
    assert not loads_with(vmfb, [own], "vulkan")


def test_failed_vulkan_probes_do_not_crash_the_process(compiled):
    """Compile probes whether a module loads without its encoded archive (driver.py, prune.py).
    A Vulkan device destroyed after such a failed load crashed lavapipe about one time in ten
    (a segfault that took down the whole test run), and one kept for the next probe sometimes
    failed it with a stale transient buffer; so each Vulkan probe runs in its own child: twenty
    of them, from a process which must exit cleanly, each answering "does not load"."""
    m = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    te = m.submodules["text_encoder"]
    script = (
        "import sys; from pathlib import Path\n"
        "from sdiree.compile.param_encoder import loads_with\n"
        "vmfb, own = Path(sys.argv[1]), ('text_encoder', Path(sys.argv[2]))\n"
        "assert not any(loads_with(vmfb, [own], 'vulkan') for _ in range(20))\n"
    )
    args = [str(m.path(te.vmfb)), str(m.path(te.parameters))]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_vulkan_probe_that_fails_otherwise_raises_one_line(compiled, tmp_path):
    m = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    te = m.submodules["text_encoder"]
    broken = tmp_path / "broken.vmfb"
    broken.write_bytes(m.path(te.vmfb).read_bytes()[:4096])  # a truncated module
    with pytest.raises(RuntimeError, match=r"loading broken\.vmfb on vulkan failed: \w+") as e:
        loads_with(broken, [("text_encoder", m.path(te.parameters))], "vulkan")
    assert "\n" not in str(e.value)


def _native_linear_capped_specs(root: Path, cap: int) -> Path:
    """The shipped specs with vulkan's linears traced natively (the UNet's batch-1 function
    then makes transposed copies at load, which the encoder precomputes) and the cap at cap."""
    specs = root / "specs"
    shutil.copytree(ROOT / "specs", specs)
    data = json.loads((specs / "targets.json").read_text())
    vk = data["targets"]["vulkan-spirv"]
    assert sum(f.startswith(CAP_FLAG) for f in vk["flags"]) == 1, "the shipped cap moved"
    vk["flags"] = [f"{CAP_FLAG}{cap}" if f.startswith(CAP_FLAG) else f for f in vk["flags"]]
    assert vk["export"].pop("linear") == "flat"
    (specs / "targets.json").write_text(json.dumps(data))
    return specs


CAP = 384 * 1024
# the tiny model for lavapipe with native linears and CAP (compiled in the background)
NATIVE_CAPPED = Queued(
    "lavapipe-native-capped",
    lambda root, model: dict(
        model_dir=model,
        target="vulkan-spirv",
        arch="lavapipe",
        dtype="fp32",
        out=root / "native-capped",
        specs_dir=_native_linear_capped_specs(root, CAP),
    ),  # fmt: skip
)


def test_encoded_parameters_respect_the_allocation_cap(compiled, tiny_model, tmp_path_factory):
    """Native linears: the tiny UNet's transposed copies (560 KiB) are precomputed by the CPU
    encoder, and with the cap below that (above the largest weight, 288 KiB: one weight is
    never split) they come in several parameters, none above it. The images of that build and
    of the shipped one are the same, pixel for pixel."""
    from PIL import Image

    from sdiree.runtime.generate import generate_to_files

    shipped = compiled.get("vulkan-spirv", "lavapipe", "fp32")
    root, _ = NATIVE_CAPPED.result(tiny_model, tmp_path_factory)
    native = root / "native-capped"
    assert load_manifest(native).submodules["unet"].encoder.driver == "local-task"
    parts = entry_views(native / "unet.encoded.irpa")
    assert len(parts) > 1 and sum(v.nbytes for v in parts.values()) > CAP
    assert max(v.nbytes for v in parts.values()) <= CAP

    images = []
    for art in (shipped, native):
        png = root / f"{art.name}.png"
        generate_to_files(
            artifact_dir=art, prompt="a red boat", negative_prompt="", steps=2,
            guidance_scale=7.5, scheduler="euler", seed=3, num_images=1, output=png,
        )  # fmt: skip
        with Image.open(png) as im:
            images.append(np.asarray(im.convert("RGB")))
    assert np.array_equal(images[0], images[1])


def _channels_last_options(root: Path, model: Path) -> dict:
    """The tiny UNet for lavapipe with cuda fp16's channels-last conv export and flags."""
    specs = root / "specs"
    shutil.copytree(ROOT / "specs", specs)
    data = json.loads((specs / "targets.json").read_text())
    cuda16 = data["targets"]["cuda"]["dtype_options"]["fp16"]
    vulkan = data["targets"]["vulkan-spirv"]
    vulkan["submodule_export"]["unet"] = {"conv": cuda16["submodule_export"]["unet"]["conv"]}
    vulkan["submodule_flags"] = {"unet": cuda16["submodule_flags"]["unet"]}
    (specs / "targets.json").write_text(json.dumps(data))
    return dict(
        model_dir=model, target="vulkan-spirv", arch="lavapipe", out=root / "art",
        specs_dir=specs, submodules=("unet",),
    )  # fmt: skip


CHANNELS_LAST = Queued("lavapipe-channels-last", _channels_last_options)  # in the background


def test_channels_last_filters_run_on_a_vulkan_device(tiny_model, tmp_path_factory):
    """cuda's fp16 UNet build (filters exported channels-last into a derived archive, convs
    compiled channels-last) cannot run here; its mechanism runs where a GPU-style device does,
    on lavapipe: the module reads its scope from two archives (the model's and
    `unet.fhwc.irpa`), computes nothing from its weights at load, and both UNet functions match
    torch as the shipped lavapipe build does."""
    from sdiree.compile.verify import check_parity

    root, _ = CHANNELS_LAST.result(tiny_model, tmp_path_factory)
    art = root / "art"
    m = load_manifest(art)
    unet = m.submodules["unet"]
    assert unet.extra_parameters == (("unet.fhwc.irpa", "unet"),) and unet.encoder is None
    results = check_parity(art, submodules=["unet"])
    assert {r.function for r in results} == {"denoise", "denoise_cfg"}
    for r in results:
        assert r.rel < 5e-3, r
