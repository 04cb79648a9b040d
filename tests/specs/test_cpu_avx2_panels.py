"""The cpu target's UNet linears as weight panels on CPUs without AVX-512 (export choice
`linear: "panels"`, specs/tuning/cpu_avx2_linear_panels.mlir): the registry's `if_cpu_lacks`
gives both to fp32 UNet compiles for such CPUs only; a tiny UNet compiled for `x86-64-v3` (which
runs on any CPU of the suite) runs its linears with the 6x16 tile (the configuration dump),
matches diffusers, keeps no original linear weight the panels hold (read back exactly), and
derives the panels again from other weights at run time (`sdiree run --weights`). The speed it
is for: tools/PERFORMANCE.md (thirty-third and thirty-fourth sessions).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from configured import dump_configurations
from llvm_cpu import avx2_cpu_fp32

from sdiree.runtime.targets import Arch, load_registry

ROOT = Path(__file__).resolve().parents[2]
SPEC_REL = "tuning/cpu_avx2_linear_panels.mlir"
TILE = "vector_common_parallel = [6, 1, 16, 0]"
SUBMODULES = ("text_encoder", "unet", "vae_decoder", "vae_encoder")


def test_if_cpu_lacks_gives_panels_to_fp32_unets_on_cpus_without_avx512():
    from sdiree.compile.plan import tuning_spec

    registry = load_registry(ROOT / "specs")
    cpu = registry.target("cpu")
    zen5 = Arch(name="zen5", description="", flags=(), cpu_features=("avx2", "avx512f"))
    cpu = dataclasses.replace(cpu, arches={**cpu.arches, "zen5": zen5})
    given = set()
    for arch, preset in cpu.arches.items():
        lacks = "avx512f" not in preset.features()
        for dtype in cpu.dtypes:
            plan = SimpleNamespace(target=cpu, arch=arch, dtype=dtype, registry=registry)
            for sub in SUBMODULES:
                want = lacks and dtype == "fp32" and sub == "unet"
                assert (cpu.export_for(sub, dtype, arch).get("linear") == "panels") == want
                found = tuning_spec(plan, sub)
                assert (found is not None and found[0] == SPEC_REL) == want, (arch, dtype, sub)
                if want:
                    given.add(arch)
    assert "x86-64-v3" in given and "zen5" not in given


def test_registry_refuses_an_unknown_field_under_if_cpu_lacks(tmp_path):
    from sdiree.runtime.errors import UserError

    specs = tmp_path / "specs"
    shutil.copytree(ROOT / "specs", specs)
    data = json.loads((specs / "targets.json").read_text())
    data["targets"]["cpu"]["dtype_options"]["fp32"]["if_cpu_lacks"]["avx512f"]["flags"] = []
    (specs / "targets.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"if_cpu_lacks\.avx512f\.flags is not a known field"):
        load_registry(specs)


def _perturbed_copy(model: Path, out: Path) -> Path:
    """model with its UNet's weights moved (diffusers layout), as a user's other checkpoint."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model, out)
    (path,) = (out / "unet").glob("*.safetensors")
    rng = np.random.default_rng(5)
    sd = {k: v + (rng.standard_normal(v.shape) * 0.2 * (float(v.std()) + 1e-3)).astype(v.dtype)
          for k, v in load_file(path).items()}  # fmt: skip
    save_file(sd, str(path))
    return out


def test_avx2_unet_with_panels_matches_diffusers(compiled, tiny_model, tmp_path):
    """The suite's fp32 artifact for a CPU without AVX-512 (llvm_cpu.avx2_cpu_fp32: x86-64-v3's,
    or host's on such a CPU), its UNet's configurations read back from its compile
    (tests/configured.py)."""
    pytest.importorskip("iree.compiler")
    from safetensors.numpy import load_file

    from sdiree.compile.verify import TOLERANCE, _torch_reference, check_parity, make_inputs
    from sdiree.runtime.device_select import choose_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.session import Session
    from sdiree.runtime.weights.archive import Archive
    from sdiree.runtime.weights.derived import PANELS_PARAM
    from sdiree.runtime.weights.sources import build_overrides

    art = compiled.get(*avx2_cpu_fp32())
    manifest = load_manifest(art)
    assert list(manifest.data["submodules"]["unet"]["tuning_specs"]) == [SPEC_REL]
    dump = dump_configurations(art, "unet", tmp_path / "dump")
    texts = [f.read_text() for f in dump.glob("*.mlir")]
    panels = [t for t in texts if TILE in t]
    assert panels and not any("mmt4d" in t for t in panels)
    assert any("mmt4d" in t for t in texts)  # attention and the convs stay data-tiled

    for result in check_parity(art, model_dir=tiny_model, submodules=["unet"]):
        assert result.tolerance == TOLERANCE["fp32"] and result.ok, result.line()

    # the module reads the panels, so the original linear weights are dropped, read back exact
    (weights,) = (tiny_model / "unet").glob("*.safetensors")
    original = load_file(weights)
    pruned = Archive(art / "unet.irpa")
    linears = [k for k in original if k.endswith("to_q.weight") or k.endswith("ff.net.2.weight")]
    assert linears
    for key in linears:
        assert pruned.entries[key].recovered, key
        np.testing.assert_array_equal(pruned.array(key), original[key])
    (derived,) = [p for p in art.glob("unet.*.irpa") if "panels" in p.name]
    assert f"{linears[0][: -len('weight')]}{PANELS_PARAM}" in Archive(derived).entries

    # another checkpoint at run time: its panels are derived again from its linear weights
    sys.path.insert(0, str(ROOT / "tools"))
    from to_single_file import write_single_file

    moved = _perturbed_copy(tiny_model, tmp_path / "moved-model")
    single = write_single_file(moved, tmp_path / "moved.safetensors")
    info, _ = choose_device(manifest, None)
    overrides, _, _ = build_overrides(manifest, weights=single)
    inputs = make_inputs(manifest, "unet", "denoise", 0)
    got = Session(manifest, info, ["unet"], overrides).call("unet", "denoise", *inputs)
    (want,) = _torch_reference(moved, manifest)("unet", inputs)
    assert np.abs(got[0] - want).max() <= 1e-4 * np.abs(want).max()
