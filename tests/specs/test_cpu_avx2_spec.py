"""The cpu target's AVX2 preprocessing spec (specs/tuning/cpu_avx2_winograd_untiled.mlir): the
registry gives it to fp32 VAE compiles for CPUs without avx512f only; on a small module it
leaves a split Winograd product out of data tiling with its 6x16 tile and data-tiles every other
f32 contraction (iree-compile's configuration dump shows both), with the data-tiled build's
results; and a VAE decoder whose split Winograd convs it takes, compiled for an AVX2 CPU (the
`x86-64-v3` preset, which runs on any CPU of the suite), matches diffusers (the VAE encoder
takes the same spec for the same products; at SD 1.5 size both are bit-identical to builds
without it). The AVX2 speed it
is for is measured in tools/PERFORMANCE.md (thirty-second session).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from compile_queue import Queued
from configured import configurations

from sdiree.runtime.targets import Arch, load_registry

ROOT = Path(__file__).resolve().parents[2]

SPEC_REL = "tuning/cpu_avx2_winograd_untiled.mlir"
SPEC = ROOT / "specs" / SPEC_REL
SPEC_FLAG = "--iree-preprocessing-transform-spec-filename="
SUBMODULES = ("text_encoder", "unet", "vae_decoder", "vae_encoder")
TILE_6X16 = "vector_common_parallel = [6, 16, 0]"

# One tile element of a Winograd weight times the transformed input (the split form's product)
# and a linear layer's transposed-weight matmul, as iree-compile sees them after input
# conversion; both 96x64 @ 64x128.
MODULE = """
func.func @main(%x: tensor<96x64xf32>, %w: tensor<4x64x128xf32>, %lin: tensor<128x64xf32>)
    -> (tensor<96x128xf32>, tensor<96x128xf32>) {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<96x128xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<96x128xf32>) -> tensor<96x128xf32>
  %s = tensor.extract_slice %w[1, 0, 0] [1, 64, 128] [1, 1, 1]
      : tensor<4x64x128xf32> to tensor<1x64x128xf32>
  %u = tensor.collapse_shape %s [[0, 1], [2]] : tensor<1x64x128xf32> into tensor<64x128xf32>
  %product = linalg.matmul ins(%x, %u : tensor<96x64xf32>, tensor<64x128xf32>)
      outs(%z : tensor<96x128xf32>) -> tensor<96x128xf32>
  %te = tensor.empty() : tensor<64x128xf32>
  %t = linalg.transpose ins(%lin : tensor<128x64xf32>) outs(%te : tensor<64x128xf32>)
      permutation = [1, 0]
  %linear = linalg.matmul ins(%x, %t : tensor<96x64xf32>, tensor<64x128xf32>)
      outs(%z : tensor<96x128xf32>) -> tensor<96x128xf32>
  return %product, %linear : tensor<96x128xf32>, tensor<96x128xf32>
}
"""


def _plan(cpu, registry, arch: str, dtype: str):
    return SimpleNamespace(target=cpu, arch=arch, dtype=dtype, registry=registry)


def test_registry_gives_the_spec_to_fp32_vaes_on_cpus_without_avx512():
    from sdiree.compile.plan import flags_for

    registry = load_registry()
    cpu = registry.target("cpu")
    # a preset of a CPU with AVX-512 beside the shipped ones (x86-64-v3 lacks it; host: this CPU)
    zen5 = Arch(name="zen5", description="", flags=(), cpu_features=("avx2", "avx512f"))
    cpu = dataclasses.replace(cpu, arches={**cpu.arches, "zen5": zen5})
    given = set()
    for arch, preset in cpu.arches.items():
        lacks = "avx512f" not in preset.features()
        for dtype in cpu.dtypes:
            for sub in SUBMODULES:
                flags, specs = flags_for(_plan(cpu, registry, arch, dtype), sub)
                want = lacks and dtype == "fp32" and sub.startswith("vae_")
                assert (SPEC_REL in specs) == want, (arch, dtype, sub)
                assert (f"{SPEC_FLAG}{SPEC}" in flags) == want, (arch, dtype, sub)
                if want:
                    given.add(arch)
    assert "x86-64-v3" in given and "zen5" not in given


def test_registry_refuses_a_spec_for_an_unknown_submodule(tmp_path):
    from sdiree.runtime.errors import UserError

    specs = tmp_path / "specs"
    shutil.copytree(ROOT / "specs", specs)
    data = json.loads((specs / "targets.json").read_text())
    opt = data["targets"]["cpu"]["dtype_options"]["fp32"]
    opt["if_cpu_lacks"]["avx512f"]["preprocessing_specs"]["vae"] = SPEC_REL
    (specs / "targets.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"if_cpu_lacks\.avx512f\.preprocessing_specs names "
                       "submodule 'vae'"):  # fmt: skip
        load_registry(specs)


def _compile(src: Path, out: Path, flags: list[str], dump: Path) -> dict[str, str]:
    """iree-compile src with flags; {dispatch function: its configured source}."""
    from sdiree.compile.iree_compile import iree_compile_tool

    cmd = [iree_compile_tool(), str(src), "-o", str(out), *flags,
           f"--iree-hal-dump-executable-configurations-to={dump}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return configurations(dump)


def test_spec_unties_the_winograd_product_only_and_keeps_results(tmp_path):
    pytest.importorskip("iree.compiler")
    import iree.runtime as rt

    from sdiree.compile.plan import flags_for

    registry = load_registry()
    cpu = registry.target("cpu")
    src = tmp_path / "m.mlir"
    src.write_text(MODULE)
    spec_flags, _ = flags_for(_plan(cpu, registry, "x86-64-v3", "fp32"), "vae_decoder")
    plain = [f for f in spec_flags if not f.startswith(SPEC_FLAG)]
    assert len(plain) == len(spec_flags) - 1
    builds = {}
    for name, flags in (("plain", plain), ("spec", spec_flags)):
        vmfb = tmp_path / f"{name}.vmfb"
        builds[name] = (vmfb, _compile(src, vmfb, flags, tmp_path / f"cfg-{name}"))

    matmuls = {n: t for n, t in builds["spec"][1].items() if "matmul" in n or "mmt4d" in n}
    untiled = {n for n, t in matmuls.items() if TILE_6X16 in t}
    assert len(untiled) == 1, sorted(matmuls)
    assert "mmt4d" not in builds["spec"][1][next(iter(untiled))]
    # the linear's matmul stays data-tiled, as every matmul of the build without the spec
    assert any("mmt4d" in t for n, t in matmuls.items() if n not in untiled)
    assert not any(TILE_6X16 in t for t in builds["plain"][1].values())
    assert builds["spec"][0].read_bytes() != builds["plain"][0].read_bytes()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 64)).astype(np.float32)
    w = rng.standard_normal((4, 64, 128)).astype(np.float32)
    lin = rng.standard_normal((128, 64)).astype(np.float32)
    outs = {}
    for name, (vmfb, _) in builds.items():
        ctx = rt.SystemContext(config=rt.Config("local-task"))
        ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb.read_bytes()))
        outs[name] = [np.asarray(o) for o in ctx.modules.module.main(x, w, lin)]
    refs = (x.astype(np.float64) @ w[1], x.astype(np.float64) @ lin.T)
    for got, want, ref in zip(outs["spec"], outs["plain"], refs, strict=True):
        scale = np.abs(ref).max()
        assert np.abs(got - want).max() <= 1e-6 * scale  # the same K-ordered sums
        assert np.abs(got - ref).max() <= 1e-5 * scale


def _wide_vae_model(tiny_model: Path, out: Path) -> Path:
    """The tiny SD 1.x with a VAE of 64 channels at every level, so that its split Winograd
    products have the N (a multiple of 64) the spec takes."""
    import torch
    from diffusers import AutoencoderKL

    shutil.copytree(tiny_model, out)
    shutil.rmtree(out / "vae")
    torch.manual_seed(3)
    AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(64,) * 4,
        layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=64,
    ).save_pretrained(out / "vae")  # fmt: skip
    return out


def _avx2_decoder_options(root: Path, tiny_model: Path) -> dict:
    """The wide-VAE model's decoder for x86-64-v3 fp32, its 64² convs split (F(2x2)), its
    executables' configurations dumped."""
    model = _wide_vae_model(tiny_model, root / "wide-vae")
    specs = root / "specs"
    shutil.copytree(ROOT / "specs", specs)
    data = json.loads((specs / "targets.json").read_text())
    cpu = data["targets"]["cpu"]
    dump = root / "dump"
    preset = cpu["arches"]["x86-64-v3"]
    preset["flags"] = [*preset["flags"], f"--iree-hal-dump-executable-configurations-to={dump}"]
    # F(2x2): 16 products a split conv, not F(4x4)'s 36 (half the export and compile time);
    # the spec takes either
    cpu["submodule_export"]["vae_decoder"].update(conv="winograd", winograd_split_min_side=64)
    (specs / "targets.json").write_text(json.dumps(data))
    return dict(
        model_dir=model, target="cpu", arch="x86-64-v3", dtype="fp32", out=root / "art",
        specs_dir=specs, submodules=("vae_decoder",),
    )  # fmt: skip


AVX2_DECODER = Queued("avx2-wide-vae-decoder", _avx2_decoder_options)  # in the background


def test_avx2_vae_decoder_with_the_spec_matches_diffusers(tiny_model, tmp_path_factory, tmp_path):
    """Compiled for x86-64-v3 with the decoder's 64² convs split (F(2x2)): their products run the 6x16
    tile (the configuration dump), the manifest names the spec, the decode matches diffusers
    within fp32's tolerance, and the artifact keeps no more original weights than without it."""
    pytest.importorskip("iree.compiler")
    from sdiree.compile.verify import TOLERANCE, check_parity

    root, _ = AVX2_DECODER.result(tiny_model, tmp_path_factory)
    model, art, dump = root / "wide-vae", root / "art", root / "dump"
    manifest = json.loads((art / "manifest.json").read_text())
    assert list(manifest["submodules"]["vae_decoder"]["tuning_specs"]) == [SPEC_REL]
    texts = [f.read_text() for f in dump.glob("*.mlir")]
    assert any(TILE_6X16 in t and "mmt4d" not in t for t in texts)
    assert any("mmt4d" in t for t in texts)  # attention and the 1x1 convs stay data-tiled

    (result,) = check_parity(art, model_dir=model, submodules=["vae_decoder"])
    assert result.tolerance == TOLERANCE["fp32"] and result.ok, result.line()

    # The untiled products read their transformed weights raw (the derived archive's entries),
    # so their convs' 3x3 weights are dropped from vae.irpa all the same: read back from there
    from safetensors.numpy import load_file

    from sdiree.runtime.weights.archive import Archive

    (weights,) = (model / "vae").glob("*.safetensors")
    original = load_file(weights)
    pruned = Archive(art / "vae.irpa")
    split = [f"decoder.up_blocks.3.resnets.{r}.conv{c}.weight" for r in (0, 1) for c in (1, 2)]
    for key in split:
        assert pruned.entries[key].recovered, key
        want = original[key]
        assert np.abs(pruned.array(key) - want).max() <= 1e-5 * np.abs(want).max(), key
    kept = [k for k, e in pruned.entries.items() if k.startswith("decoder.") and not e.recovered
            and len(e.shape) == 4 and tuple(e.shape[2:]) == (3, 3)]  # fmt: skip
    assert not kept  # as without the spec: every 3x3 weight of the decoder is read back

    # another VAE at run time (`sdiree run --vae`): the raw transformed weights the untiled
    # products read are derived again from its weights
    _run_time_vae_matches_torch(art, model, tmp_path / "moved.safetensors")


def _run_time_vae_matches_torch(art: Path, model: Path, moved: Path) -> None:
    import torch
    from diffusers import AutoencoderKL
    from safetensors.numpy import load_file, save_file
    from to_single_file import vae_to_ldm  # tools/, on sys.path via conftest

    from sdiree.compile.exporters.vae import VaeDecodeEntry
    from sdiree.compile.verify import make_inputs
    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.session import Session
    from sdiree.runtime.weights.sources import build_overrides

    (src,) = (model / "vae").glob("*.safetensors")
    rng = np.random.default_rng(8)
    sd = {k: v + (rng.standard_normal(v.shape) * 0.2 * (float(v.std()) + 1e-3)).astype(v.dtype)
          for k, v in load_file(src).items()}  # fmt: skip
    config = json.loads((model / "vae" / "config.json").read_text())
    save_file({k: np.ascontiguousarray(v) for k, v in vae_to_ldm(sd, config).items()}, str(moved))
    manifest = load_manifest(art)
    info, _ = choose_device(manifest, None)
    overrides, _, _ = build_overrides(manifest, vae=moved)
    inputs = make_inputs(manifest, "vae_decoder", "decode", 0)
    got = Session(manifest, info, ["vae_decoder"], overrides).call("vae_decoder", "decode", *inputs)
    vae = AutoencoderKL.from_pretrained(model / "vae").eval()
    vae.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    with torch.no_grad():
        want = VaeDecodeEntry(vae, manifest.data["vae_scaling"]["factor"])(
            *[torch.from_numpy(a) for a in inputs]
        ).numpy()
    assert np.abs(got[0] - want).max() <= 1e-4 * np.abs(want).max()
