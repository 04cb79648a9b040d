"""Compile the tiny model for all four targets; cpu and vulkan (lavapipe) match torch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llvm_cpu import laid_out_cpu_fp32

from sdiree.compile.verify import TOLERANCE, check_parity
from sdiree.runtime.fileutil import sha256_file
from sdiree.runtime.manifest import check_files, load_manifest
from sdiree.runtime.targets import load_registry
from sdiree.runtime.weights.archive import Archive
from sdiree.runtime.weights.recover import sidecar_path

SUBMODULES = {"text_encoder", "unet", "vae_decoder", "vae_encoder"}


def assert_manifest_complete(out, target, arch, dtype):
    m = load_manifest(out)
    check_files(m)  # every listed file exists and matches its sha256
    d = m.data
    assert d["schema_version"] == 6
    assert d["target"] == {**d["target"], "name": target, "arch": arch}
    assert d["dtype"] == dtype
    assert d["iree_compiler_version"].startswith("3.13")
    assert len(d["model"]["content_hash"]) == 64
    assert set(m.submodules) == SUBMODULES
    for name, sub in d["submodules"].items():
        assert sub["vmfb"] in d["files"] and sub["parameters"] in d["files"]
        assert sub["flags"], name
        assert any(f.startswith("--iree-hal-target-device") for f in sub["flags"])
        for fn in sub["functions"].values():
            for t in fn["inputs"] + fn["outputs"]:
                assert t["name"] and all(isinstance(s, int) for s in t["shape"]) and t["dtype"]
    unet = m.submodules["unet"].functions
    b = d["image"]["batch_size"]
    assert unet["denoise_cfg"].inputs[0].shape[0] == b  # the latents once for both halves
    assert (
        unet["denoise_cfg"].inputs[2].shape[0] == unet["denoise_cfg"].outputs[0].shape[0] == 2 * b
    )
    assert unet["denoise"].inputs[0].shape[0] == b
    assert m.submodules["text_encoder"].functions["encode"].outputs[1].name == "pooled_output"
    assert d["vae_scaling"]["applied_by"] == "module"
    assert "tokenizer/vocab.json" in d["files"] and "scheduler/scheduler_config.json" in d["files"]
    # vae_decoder and vae_encoder share one archive; every archive is inside the artifact dir
    # (the shared ones as hardlinks to the compile cache's)
    assert (
        d["submodules"]["vae_decoder"]["parameters"] == d["submodules"]["vae_encoder"]["parameters"]
    )
    assert all(
        "/" not in s["parameters"] and not s["parameters"].startswith("..")
        for s in d["submodules"].values()
    )
    return m


@pytest.mark.parametrize(
    "target,arch,dtype",
    [
        ("cpu", "host", "fp32"),
        ("vulkan-spirv", "lavapipe", "fp32"),
        ("cpu", "host", "fp16"),
        ("cpu", "host", "bf16"),
    ],
)
def test_compiled_modules_match_torch(compiled, target, arch, dtype):
    out = compiled.get(target, arch, dtype)
    assert_manifest_complete(out, target, arch, dtype)
    results = check_parity(out)
    assert {r.submodule for r in results} == SUBMODULES
    for r in results:
        assert r.tolerance == TOLERANCE[dtype]
        assert r.ok, r.line()
    if dtype == "fp32":
        assert max(r.rel for r in results) <= 1e-4


def test_parity_of_chosen_functions_only(compiled):
    """`verify --submodules unet --functions denoise`: one call, as for the full-size checks."""
    results = check_parity(compiled.get("cpu", "host", "fp32"), submodules=["unet"],
                           functions=["denoise"])  # fmt: skip
    assert [(r.submodule, r.function) for r in results] == [("unet", "denoise")]
    assert results[0].ok, results[0].line()


def test_vulkan_fp16_compiles_for_lavapipe(compiled):
    """fp16 is the GPU default; lavapipe emulates fp16 so slowly (minutes per tiny UNet call)
    that its parity is checked on cpu fp16 above and on real GPUs by tools/parity.py."""
    out = compiled.get("vulkan-spirv", "lavapipe", "fp16")
    m = assert_manifest_complete(out, "vulkan-spirv", "lavapipe", "fp16")
    assert m.submodules["unet"].functions["denoise_cfg"].inputs[0].dtype == "float16"
    results = check_parity(out, submodules=["text_encoder"])
    assert all(r.ok for r in results), [r.line() for r in results]


# cuda fp16 runs right only where a GPU is lent (checked on an H100: tools/PERFORMANCE.md).
@pytest.mark.parametrize(
    "target,arch,dtype", [("rocm", "gfx942", "fp16"), ("cuda", "sm_80", "fp16")]
)
def test_gpu_targets_compile_and_load(compiled, target, arch, dtype):
    import iree.runtime as rt

    out = compiled.get(target, arch, dtype)
    m = assert_manifest_complete(out, target, arch, dtype)
    instance = rt.VmInstance()
    expected_format = {"rocm": b"rocm-hsaco-fb", "cuda": b"cuda-nvptx-fb"}[target]
    for name, sub in m.submodules.items():
        vmfb = m.path(sub.vmfb)
        module = rt.VmModule.mmap(instance, str(vmfb))  # parses: a well-formed module
        for fn in sub.functions:
            assert module.lookup_function(fn) is not None, (name, fn)
        assert expected_format in vmfb.read_bytes(), f"{name}.vmfb has no {target} executable"


def test_parameters_shared_across_targets(compiled):
    """Artifacts of one model and dtype share the compile cache's archive: fp16 GPU ones link
    it (no extra disk; their encoders' layouts are not learned, so nothing is pruned); fp32
    ones, cpu and vulkan alike, keep a pruned copy of it (compile/prune.py) whose kept and
    listed weights are the same set."""
    rocm = load_manifest(compiled.get("rocm", "gfx942", "fp16"))
    cuda = load_manifest(compiled.get("cuda", "sm_80", "fp16"))
    a = load_manifest(compiled.get(*laid_out_cpu_fp32()))
    b = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    for sub in ("unet", "text_encoder", "vae_decoder"):
        pr, pc = (
            rocm.path(rocm.submodules[sub].parameters),
            cuda.path(cuda.submodules[sub].parameters),
        )
        assert pr.stat().st_nlink >= 3, "the shared parameter archive must be a link"
        assert pr.samefile(pc)
        assert not sidecar_path(pr).exists()
        pa, pb = a.path(a.submodules[sub].parameters), b.path(b.submodules[sub].parameters)
        assert not pa.samefile(pb)

        def listed(p):
            side = sidecar_path(p)
            dropped = json.loads(side.read_text())["keys"] if side.exists() else {}
            return set(Archive(p).entries) | set(dropped)

        assert listed(pa) == listed(pb)
    params = a.path(a.submodules["unet"].parameters)
    assert a.data["files"][a.submodules["unet"].parameters] == sha256_file(params)


def test_export_choice_differs_by_target(compiled):
    def manifest(target, arch, dtype):
        return json.loads((compiled.get(target, arch, dtype) / "manifest.json").read_text())

    cpu16, rocm16 = manifest("cpu", "host", "fp16"), manifest("rocm", "gfx942", "fp16")
    assert cpu16["target"]["export"]["attention"] == "chunked"
    assert rocm16["target"]["export"]["attention"] == "sdpa"
    assert cpu16["submodules"]["unet"]["mlir"] != rocm16["submodules"]["unet"]["mlir"]
    # cpu exports its convolutions as Winograd/im2col matmuls, vulkan keeps Conv2d
    cpu32, vk32 = manifest("cpu", "host", "fp32"), manifest("vulkan-spirv", "lavapipe", "fp32")
    assert cpu32["target"]["export"]["conv"] == "winograd"
    # ... the VAE with F(4x4,3x3), its own choice in the preset, recorded per submodule
    assert cpu32["submodules"]["unet"]["export"]["conv"] == "winograd"
    preset = load_registry().target("cpu").export_for("unet", "fp32", "host")
    unet32 = cpu32["submodules"]["unet"]["export"]
    assert unet32.get("winograd4_min_side") == preset.get("winograd4_min_side")
    assert unet32.get("amx_operands") == preset.get("amx_operands")  # bf16x3 on an AMX CPU
    assert cpu32["submodules"]["vae_decoder"]["export"]["conv"] == "winograd4"
    assert cpu32["submodules"]["vae_decoder"]["mlir"] != vk32["submodules"]["vae_decoder"]["mlir"]
    assert vk32["target"]["export"].get("conv", "native") == "native"
    assert cpu32["submodules"]["unet"]["mlir"] != vk32["submodules"]["unet"]["mlir"]
    # the same export choices and export dtype share one exported MLIR (cpu bf16's text
    # encoder over fp32's, except on AMX, where bf16's linears take the kernel); bf16 exports
    # its convolutions as F(2x2,3x3) Winograd, not F(4x4) (test_winograd_bf16.py), so its UNet
    # and VAE have their own
    bf16 = manifest("cpu", "host", "bf16")
    cpu = load_registry().target("cpu")
    same = cpu.export_for("text_encoder", "fp32", "host") == cpu.export_for(
        "text_encoder", "bf16", "host"
    )
    te32, te16 = (m["submodules"]["text_encoder"] for m in (cpu32, bf16))
    assert (te32["mlir"] == te16["mlir"]) == same
    assert (te16["export"].get("linear") == "amx") == (not same)
    assert bf16["submodules"]["vae_decoder"]["export"]["conv"] == "winograd"
    assert "winograd4_min_side" not in bf16["submodules"]["unet"]["export"]
    for sub in ("unet", "vae_decoder"):
        assert cpu32["submodules"][sub]["mlir"] != bf16["submodules"][sub]["mlir"]


def test_wrong_arch_is_recorded_for_runtime(compiled):
    m = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    assert m.arch == "lavapipe" and m.data["target"]["arch_cpu_emulated"] is True
    assert np.dtype(m.submodules["unet"].functions["denoise"].inputs[0].dtype) == np.float32


def test_cpu_bf16_shares_the_fp32_weights_and_adds_its_flags(compiled):
    fp32 = load_manifest(compiled.get("cpu", "host", "fp32"))
    bf16 = load_manifest(compiled.get("cpu", "host", "bf16"))
    for name, sub in bf16.data["submodules"].items():
        assert sub["parameters"] == fp32.data["submodules"][name]["parameters"]
        assert "--iree-global-opt-demote-contraction-inputs-type=bf16" in sub["flags"]
        assert not any("demote" in f for f in fp32.data["submodules"][name]["flags"])


def test_default_dtype_falls_back_when_refused_and_says_why(tiny_model, tmp_path):
    import io

    from sdiree.compile.driver import CompileOptions, resolve
    from sdiree.compile.report import Reporter

    log = io.StringIO()
    opts = CompileOptions(tiny_model, "vulkan-spirv", arch="baseline", out=tmp_path / "a")
    plan = resolve(opts, Reporter(stream=log))
    assert plan.dtype == "fp32"  # the target's fp16 default is refused for baseline
    assert "dtype: fp32, as fp16 is refused for baseline" in log.getvalue()
    plan = resolve(CompileOptions(tiny_model, "vulkan-spirv", arch="rdna2", out=tmp_path / "b"),
                   Reporter(stream=io.StringIO()))  # fmt: skip
    assert plan.dtype == "fp16"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cpu_weights_are_derived_at_export_and_encoded_at_compile(compiled, compile_cache):
    """cpu: the Winograd weights are derived at export into their own shared archive; every
    submodule's repacked weights were computed by its encoder at compile time into
    `<submodule>.encoded.irpa` beside the vmfb, which the artifact then needs instead of the
    derived archive. Without it the module cannot load; vulkan has no derived archive.
    On a CPU without avx512f the UNet's linears are panels (specs/targets.json), which the
    module reads as they were derived: then its derived archive is in the artifact too, as it
    is where the module reads some Winograd weights in place (llvm_cpu.
    unet_winograd_read_in_place: the tiny model on an AVX-512 CPU without AMX)."""
    import iree.runtime as rt
    from llvm_cpu import host_unet_takes_panels, unet_winograd_read_in_place

    from sdiree.compile.param_encoder import loads_with

    kind = laid_out_cpu_fp32()  # on an AMX CPU, host's VAE convs are on the AMX conv kernel
    panels = host_unet_takes_panels(kind[1])
    derived_name = "unet.winograd2+panels.irpa" if panels else "unet.winograd2.irpa"
    out = compiled.get(*kind)
    m = load_manifest(out)
    for name, sub in m.submodules.items():
        assert sub.extra_parameters[-1] == (f"{name}.encoded.irpa", f"{name}_encoded"), name
        assert all(path in m.data["files"] for path, _ in sub.extra_parameters)
    # The UNet's Winograd weights all reach it through the encoder, so without panels the
    # artifact does not need their archive; the VAE decoder's 3-channel conv_out is not
    # data-tiled and reads its derived weight directly, so that archive is listed (and needed).
    listed = panels or bool(unet_winograd_read_in_place(m))
    unet_extra = [p for p, _ in m.submodules["unet"].extra_parameters]
    assert unet_extra == ([derived_name] if listed else []) + ["unet.encoded.irpa"]
    vae = m.submodules["vae_decoder"]
    assert [s for _, s in vae.extra_parameters] == ["vae", "vae_decoder_encoded"]
    assert vae.extra_parameters[0][0] == "vae.winograd4.irpa"  # its F(4x4) weights, in the artifact
    encoded_only = [
        ("vae", m.path(vae.parameters)),
        ("vae_decoder_encoded", out / vae.extra_parameters[1][0]),
    ]
    assert not loads_with(m.path(vae.vmfb), encoded_only, "local-task")
    # Without panels (or weights read in place) the UNet's derived archive stays in the compile
    # cache: nothing at run time reads it. With them, it is in the artifact, for what the
    # module reads.
    assert (out / derived_name).exists() == listed
    (derived,) = (compile_cache / compiled.model.name).rglob(f"params/*-fp32/{derived_name}")
    index = rt.ParameterIndex()
    index.load(str(derived))
    keys = [k for k, _ in index.items()]
    assert any(k.endswith(".weight_winograd") for k in keys)
    assert any(k.endswith(".weight_panels") for k in keys) == panels
    assert all(k.endswith((".weight_winograd", ".weight_panels")) for k in keys)
    assert (
        not m.path(m.submodules["text_encoder"].parameters)
        .with_name("text_encoder.winograd2.irpa")
        .exists()
    )  # no convs, nothing derived

    # The unet module loads from those two archives and refuses to without the encoded one
    # (it does not recompute it).
    unet = m.submodules["unet"]
    vmfb = m.path(unet.vmfb)
    every = [(scope, out / path) for path, scope in unet.archives()]
    assert loads_with(vmfb, every, "local-task")
    assert not loads_with(vmfb, [a for a in every if a[0] != "unet_encoded"], "local-task")
    # vulkan derives no weights at export: all but its UNet load an encoded archive beside the
    # weights (tests/compile/test_gpu_encoded.py)
    vk = load_manifest(compiled.get("vulkan-spirv", "lavapipe", "fp32"))
    for name, s in vk.submodules.items():
        want = ((f"{name}.encoded.irpa", f"{name}_encoded"),) if name != "unet" else ()
        assert s.extra_parameters == want, name


@pytest.mark.parametrize(
    "arch,dtype,noted", [("x86-64-v3", "bf16", True), ("x86-64-v3", "fp32", False)]
)
def test_compile_notes_a_dtype_the_cpu_lacks_features_for(tiny_model, tmp_path, arch, dtype, noted):
    """bf16 for a CPU without avx512_bf16 compiles, slower than fp32 there: compile says so."""
    import io

    from sdiree.compile.driver import CompileOptions, resolve
    from sdiree.compile.report import Reporter

    said = io.StringIO()
    opts = CompileOptions(tiny_model, "cpu", arch=arch, dtype=dtype, out=tmp_path / "a")
    plan = resolve(opts, Reporter(stream=said))
    assert plan.dtype == dtype and not (tmp_path / "a").exists()
    assert ("has no avx512_bf16, so bf16 is compiled without" in said.getvalue()) == noted


def _probe_registry(tmp_path, features, note=None):
    """A copy of the shipped specs with an arch `probe` whose CPU has features (and a bf16 note
    for amx_bf16 when note is given)."""
    import json
    import shutil

    from sdiree.runtime.targets import default_specs_dir

    specs = tmp_path / "specs"
    shutil.copytree(default_specs_dir(), specs)
    data = json.loads((specs / "targets.json").read_text())
    base = ["avx2", "fma", "avx512f"]
    data["targets"]["cpu"]["arches"]["probe"] = {"flags": [], "cpu_features": [*base, *features]}
    if note:
        data["targets"]["cpu"]["dtype_options"]["bf16"]["notes_if_cpu_has"] = {"amx_bf16": note}
    (specs / "targets.json").write_text(json.dumps(data))
    return specs


@pytest.mark.parametrize(
    "features,dtype,noted",
    [
        (("amx_bf16", "avx512_bf16"), "bf16", True),
        (("avx512_bf16",), "bf16", False),
        (("amx_bf16", "avx512_bf16"), "fp32", False),
    ],
)
def test_compile_says_a_dtypes_note_for_a_feature_the_cpu_has(
    tiny_model, tmp_path, features, dtype, noted
):
    """The registry's `notes_if_cpu_has` are said at compile for an arch whose CPU has the
    feature, for that dtype only."""
    import io

    from sdiree.compile.driver import CompileOptions, resolve
    from sdiree.compile.report import Reporter

    specs = _probe_registry(tmp_path, features, note="probe note: this CPU has AMX")
    said = io.StringIO()
    opts = CompileOptions(
        tiny_model, "cpu", arch="probe", dtype=dtype, out=tmp_path / "a", specs_dir=specs
    )
    resolve(opts, Reporter(stream=said))
    assert ("probe note: this CPU has AMX" in said.getvalue()) == noted


AMX_CPU = ("amx_tile", "amx_bf16", "avx512_bf16")


@pytest.mark.parametrize(
    "features,dtype,isa",
    [
        (AMX_CPU, "bf16", "amx"),
        (("amx_tile", "amx_bf16"), "bf16", "amx"),
        (("avx512_bf16",), "bf16", "avx512_bf16"),
        ((), "bf16", None),
        (AMX_CPU, "fp32", "amx"),
        (("avx512_bf16",), "fp32", None),
        ((), "fp32", None),
    ],
)
def test_unets_linears_take_the_kernels_on_an_amx_or_avx512_bf16_cpu(
    tmp_path, features, dtype, isa
):
    """cpu bf16 and fp32 on a CPU with AMX (`if_cpu_has.amx_bf16`), and bf16 on one with
    avx512_bf16 and no AMX (`if_cpu_has.avx512_bf16`, the kernels on vdpbf16ps: `kernel_isa`):
    the UNet's linears, and the UNet's and the VAE's convs, split Winograd products and attention,
    go to sdiree's kernels (compile/exporters/linear_amx.py, amx_matmul.py), and the UNet runs
    channels-last, fp32 with every operand as two bf16 parts (`amx_operands: bf16x3`, AMX only);
    bf16 puts the text encoders' linears on the kernel too (the text's 77 tokens padded to 96),
    and on AMX the VAE's attention projections; other CPUs keep iree's own and NCHW."""
    from sdiree.compile.exporters import cpu_requires, kernel_isa
    from sdiree.runtime.targets import load_registry

    cpu = load_registry(_probe_registry(tmp_path, features)).targets["cpu"]
    unet = cpu.export_for("unet", dtype, "probe")
    amx = isa is not None
    # the probe's CPU has avx512f: fp32 without AMX takes the fp32 kernels, channels-last too
    f32_kernels = dtype == "fp32" and not amx
    assert (unet.get("linear") == "amx") == amx
    assert (unet.get("linear") == "f32") == f32_kernels
    assert (unet.get("layout") == "channels_last") == (amx or f32_kernels)
    split = amx and dtype == "fp32"
    subs = ("unet", "vae_decoder", "vae_encoder")
    for sub in subs:
        assert (cpu.export_for(sub, dtype, "probe").get("matmul_kernel") == "amx") == amx
        assert (cpu.export_for(sub, dtype, "probe").get("amx_operands") == "bf16x3") == split
        if amx:
            assert kernel_isa(cpu.export_for(sub, dtype, "probe")) == isa
    # without AMX products are dear: the UNet's convs all Winograd, none on the direct kernel
    assert (unet.get("direct_convs") == "none") == (isa == "avx512_bf16")
    needs = cpu_requires(cpu.export_for(sub, dtype, "probe") for sub in subs)
    assert ("amx_tile" in needs) == (isa == "amx")
    assert ("avx512_bf16" in needs) == amx
    # the text encoders' linears: on the kernels in bf16 (AMX's: ~4x faster at SDXL size; the
    # avx512_bf16 build's on a Zen), on the fp32 kernel in fp32 without AMX (the probe's CPU has
    # avx512f), iree's elsewhere (fp32 on AMX, not measured there)
    text_amx = isa is not None and dtype == "bf16"
    for sub in ("text_encoder", "text_encoder_2"):
        te = cpu.export_for(sub, dtype, "probe")
        assert (te.get("linear") == "amx") == text_amx, (sub, te)
        assert (te.get("linear") == "f32") == f32_kernels, (sub, te)
        assert kernel_isa(te) == (isa if text_amx else "amx")  # the default where unused
        assert ("amx_tile" in cpu_requires([te])) == (text_amx and isa == "amx")
    assert "winograd4_min_side" not in unet or not amx  # its convs on the conv kernel
    # and the VAE's mid attention projections (4096 tokens at 512²: decode x0.96 on AMX in bf16;
    # no gain measured in fp32's bf16x3, nor on the avx512_bf16 kernels: a Zen 5's decode x1.008)
    for sub in ("vae_decoder", "vae_encoder"):
        assert (cpu.export_for(sub, dtype, "probe").get("linear") == "amx") == (
            text_amx and isa == "amx"
        )
    assert "matmul_kernel" not in cpu.export_for("text_encoder", dtype, "probe")
    # channels-last concatenations stay on the channels (no transposes around them)
    flags = cpu.compile_flags("probe", dtype, "unet")
    outer = [f for f in flags if f.startswith("--iree-opt-outer-dim-concat")]
    assert (outer[-1:] == ["--iree-opt-outer-dim-concat=false"]) == (amx or f32_kernels), outer
    assert not any(
        "outer-dim-concat=false" in f for f in cpu.compile_flags("probe", dtype, "vae_decoder")
    )


def test_the_v4_bf16_preset_compiles_bf16_on_the_avx512_kernels_and_fp32_on_irees():
    """`--arch x86-64-v4-bf16` (a Zen 4/5 CPU, from any machine): bf16 takes sdiree's kernels on
    vdpbf16ps, never AMX; fp32 stays on iree's own code (bf16x3 needs AMX's rate)."""
    from sdiree.compile.exporters import cpu_requires
    from sdiree.runtime.targets import load_registry

    cpu = load_registry().target("cpu")
    unet = cpu.export_for("unet", "bf16", "x86-64-v4-bf16")
    assert unet["kernel_isa"] == "avx512_bf16" and unet["linear"] == "amx"
    assert unet["direct_convs"] == "none"
    needs = cpu_requires(
        cpu.export_for(s, "bf16", "x86-64-v4-bf16") for s in ("unet", "vae_decoder")
    )
    assert needs and not any(f.startswith("amx") for f in needs)
    assert set(needs) <= cpu.arch("x86-64-v4-bf16").features()
    flags = cpu.compile_flags("x86-64-v4-bf16", "bf16", "unet")
    assert "--iree-llvmcpu-target-cpu=x86-64-v4" in flags
    assert "--iree-llvmcpu-enable-ukernels=none" not in flags  # iree's bf16 ukernel stays on
    # fp32 there: sdiree's fp32 FMA kernels (linear_f32.py, attention_f32.py), not bf16x3
    fp32 = cpu.export_for("unet", "fp32", "x86-64-v4-bf16")
    assert fp32["linear"] == "f32" and fp32["attention"] == "fused_f32"
    assert fp32["matmul_kernel"] == "f32"  # the split Winograd products too
    assert fp32["winograd_kernel"] == "fused"  # the F(2x2) convs on the fp32 Winograd kernels
    assert fp32["plain_from_downscale"] == 8  # the 8x8 convs plain: no transformed weight


@pytest.mark.parametrize(
    "base,features,attention",
    [
        (("avx2", "fma", "avx512f"), ("avx512_bf16",), "fused_f32"),  # Zen 4 and 5
        (("avx2", "fma", "avx512f"), (), "fused_f32"),  # AVX-512 without bf16
        (("avx2", "fma", "avx512f"), AMX_CPU, "chunked"),  # AMX's own attention kernel
        (("avx2", "fma"), (), "chunked"),  # AVX2 only
    ],
)
def test_fp32_unet_takes_the_f32_kernels_on_avx512_without_amx(tmp_path, base, features, attention):
    """cpu fp32 (`if_cpu_has.avx512f`): the UNet's attention and linears on the fp32 FMA kernels
    (compile/exporters/attention_f32.py, linear_f32.py), whose AVX-512 the manifest then
    requires, and the text encoders' linears on the fp32 kernel; an AMX CPU keeps `chunked` (its
    bf16x3 AMX kernels), AVX2 and the VAE too."""
    import json

    from sdiree.compile.exporters import cpu_requires
    from sdiree.runtime.targets import load_registry

    specs = _probe_registry(tmp_path, features)
    data = json.loads((specs / "targets.json").read_text())
    data["targets"]["cpu"]["arches"]["probe"]["cpu_features"] = [*base, *features]
    (specs / "targets.json").write_text(json.dumps(data))
    cpu = load_registry(specs).targets["cpu"]
    unet = cpu.export_for("unet", "fp32", "probe")
    assert unet["attention"] == attention
    f32 = attention == "fused_f32"
    assert (unet.get("linear") == "f32") == f32  # the linears on the fp32 kernel too
    # the F(2x2) convs on the fp32 Winograd kernels; never the bf16 ones on an AMX CPU
    assert (unet.get("winograd_kernel") == "fused") == f32
    for sub in ("text_encoder", "vae_decoder", "vae_encoder"):
        assert cpu.export_for(sub, "fp32", "probe").get("attention") != "fused_f32"
    for sub in ("vae_decoder", "vae_encoder"):
        assert cpu.export_for(sub, "fp32", "probe").get("linear") != "f32"
    # the text encoders' linears on the fp32 kernel where the UNet's are
    te = cpu.export_for("text_encoder", "fp32", "probe")
    assert (te.get("linear") == "f32") == f32
    assert cpu.export_for("unet", "bf16", "probe")["attention"] == "chunked"
    assert cpu.export_for("unet", "bf16", "probe").get("linear") != "f32"
    needs = cpu_requires([unet])
    assert ("avx512f" in needs) == (f32 or "amx_bf16" in features)
