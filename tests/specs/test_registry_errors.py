"""A malformed --specs registry is one clear line naming the file and the field, never a
traceback: truncated or non-object JSON, missing or mistyped fields, names of presets, dtypes or
submodules that do not exist."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from sdiree.runtime.errors import UserError
from sdiree.runtime.targets import default_specs_dir, load_registry


def _edit(change):
    """A mutation of the parsed targets.json: change(data) edits it in place, or returns the
    value that replaces it."""

    def mutate(path):
        data = json.loads(path.read_text())
        new = change(data)
        path.write_text(json.dumps(data if new is None else new))

    return mutate


def _cpu(change):
    return _edit(lambda d: change(d["targets"]["cpu"]) and None)


def _truncate(path):
    text = path.read_text()
    path.write_text(text[: len(text) // 3])


# (mutation of specs/targets.json, what the one-line error says)
CASES = {
    "truncated": (_truncate, "targets.json is not valid JSON"),
    "binary": (lambda p: p.write_bytes(b"\xff\xfe\x00"), "targets.json is not valid JSON"),
    "a-list": (_edit(lambda d: [d]), "targets.json holds a JSON list, not an object"),
    "no-targets": (_edit(lambda d: d.pop("targets") and None), "has no 'targets'"),
    "targets-a-list": (
        _edit(lambda d: d.__setitem__("targets", [])),
        "targets must be an object of objects",
    ),
    "target-a-string": (
        _edit(lambda d: d["targets"].__setitem__("cpu", "llvm-cpu")),
        "targets must be an object of objects",
    ),
    "no-driver": (_cpu(lambda t: t.pop("driver")), "targets.cpu has no 'driver'"),
    "no-arches": (_cpu(lambda t: t.pop("arches")), "targets.cpu has no 'arches'"),
    "flags-a-string": (
        _cpu(lambda t: t.__setitem__("flags", "--iree-opt-level=O3")),
        "targets.cpu.flags must be a list of strings",
    ),
    "arch-flags-a-number": (
        _cpu(lambda t: t["arches"]["host"].__setitem__("flags", 3)),
        "targets.cpu.arches.host.flags must be a list of strings, not 3",
    ),
    "misspelt-field": (
        _cpu(lambda t: t.__setitem__("flag", [])),
        "targets.cpu.flag is not a known field",
    ),
    "default-arch-missing": (
        _cpu(lambda t: t.__setitem__("default_arch", "zen9")),
        "targets.cpu.default_arch names arch preset 'zen9', which is not one of host",
    ),
    "default-dtype-not-offered": (
        _cpu(lambda t: t.__setitem__("default_dtype", "int8")),
        "targets.cpu.default_dtype names dtype 'int8'",
    ),
    "unknown-dtype": (
        _cpu(lambda t: t.__setitem__("dtypes", ["fp32", "fp8"])),
        "targets.cpu.dtypes names dtype 'fp8'",
    ),
    "dtype-option-of-missing-dtype": (
        _cpu(lambda t: t.__setitem__("dtypes", ["fp32"])),
        "targets.cpu.dtype_options names dtype 'bf16'",
    ),
    "dtype-option-without-export-dtype": (
        _cpu(lambda t: t["dtype_options"]["bf16"].pop("export_dtype")),
        "targets.cpu.dtype_options.bf16 has no 'export_dtype'",
    ),
    "misspelt-submodule": (
        _cpu(lambda t: t["submodule_flags"].__setitem__("vae_decoer", [])),
        "targets.cpu.submodule_flags names submodule 'vae_decoer'",
    ),
    "bad-device-regex": (
        _edit(
            lambda d: d["targets"]["vulkan-spirv"]["arches"]["rdna3"].__setitem__(
                "device_match", ["RX (7"]
            )
        ),
        "targets.vulkan-spirv.arches.rdna3.device_match holds 'RX (7', not a regex",
    ),
    "unknown-attention": (
        _cpu(lambda t: t["export"].__setitem__("attention", "flash")),
        "targets.cpu.export.attention is 'flash', not one of sdpa, sdpa_pow2, sdpa_pow2_keys, decomposed, chunked",
    ),
    "unknown-conv-of-a-submodule": (
        _cpu(lambda t: t["submodule_export"]["vae_decoder"].__setitem__("conv", "fft")),
        "targets.cpu.submodule_export.vae_decoder.conv is 'fft'",
    ),
    "unknown-conv-for-a-dtype": (
        _cpu(
            lambda t: t["dtype_options"]["bf16"]["submodule_export"]["unet"].__setitem__(
                "conv", "fft"
            )
        ),
        "targets.cpu.dtype_options.bf16.submodule_export.unet.conv is 'fft'",
    ),
    "dtype-export-of-a-misspelt-submodule": (
        _cpu(lambda t: t["dtype_options"]["bf16"]["submodule_export"].__setitem__("uent", {})),
        "targets.cpu.dtype_options.bf16 names submodule 'uent'",
    ),
    "null-outside-a-dtype-option": (
        _cpu(lambda t: t["submodule_export"]["unet"].__setitem__("winograd4_min_side", None)),
        "targets.cpu.submodule_export.unet.winograd4_min_side must be a positive integer",
    ),
    "unet-only-choice-for-the-vae": (
        _cpu(lambda t: t["submodule_export"]["vae_encoder"].__setitem__("winograd4_min_side", 8)),
        "winograd4_min_side applies to the unet only",
    ),
    "layout-for-the-encoder": (
        _cpu(lambda t: t["submodule_export"]["vae_encoder"].__setitem__("layout", "channels_last")),
        "targets.cpu.submodule_export.vae_encoder.layout applies to the vae_decoder and the unet "
        "only",
    ),
    "layout-for-every-submodule": (
        _cpu(lambda t: t["export"].__setitem__("layout", "channels_last")),
        "targets.cpu.export.layout applies to the vae_decoder and the unet only",
    ),
    "unknown-matmul-kernel": (
        _cpu(lambda t: t["submodule_export"]["unet"].__setitem__("matmul_kernel", "amx2")),
        "targets.cpu.submodule_export.unet.matmul_kernel is 'amx2', not one of iree, amx",
    ),
    "unknown-layout": (
        _cpu(lambda t: t["submodule_export"]["vae_decoder"].__setitem__("layout", "nhwc")),
        "targets.cpu.submodule_export.vae_decoder.layout is 'nhwc', not one of native, "
        "channels_last",
    ),
    "winograd4-min-side-a-string": (
        _cpu(lambda t: t["submodule_export"]["unet"].__setitem__("winograd4_min_side", "32")),
        "winograd4_min_side must be a positive integer, not '32'",
    ),
    "plain-from-downscale-zero": (
        _cpu(lambda t: t["submodule_export"]["unet"].__setitem__("plain_from_downscale", 0)),
        "plain_from_downscale must be a positive integer, not 0",
    ),
    "plain-from-downscale-for-the-vae": (
        _cpu(lambda t: t["submodule_export"]["vae_decoder"].__setitem__("plain_from_downscale", 8)),
        "plain_from_downscale applies to the unet only",
    ),
    "split-min-side-negative-for-the-vae": (
        _cpu(
            lambda t: t["submodule_export"]["vae_decoder"].__setitem__(
                "winograd_split_min_side", -128
            )
        ),
        "targets.cpu.submodule_export.vae_decoder.winograd_split_min_side must be a positive "
        "integer, not -128",
    ),
    "split-min-side-a-bool": (
        _cpu(lambda t: t["export"].__setitem__("winograd_split_min_side", True)),
        "targets.cpu.export.winograd_split_min_side must be a positive integer, not True",
    ),
    "attention-block-bytes-zero": (
        _cpu(lambda t: t["submodule_export"]["unet"].__setitem__("attention_block_bytes", 0)),
        "targets.cpu.submodule_export.unet.attention_block_bytes must be a positive integer, not 0",
    ),
    "unknown-linear-of-an-arch": (
        _edit(
            lambda d: d["targets"]["vulkan-spirv"]["arches"]["ampere"]["export"].__setitem__(
                "linear", "bent"
            )
        ),
        "targets.vulkan-spirv.arches.ampere.export.linear is 'bent'",
    ),
    "encoder-without-encode-parameters": (
        _edit(lambda d: d["targets"]["rocm"].__setitem__("encode_parameters", False)),
        "targets.rocm.encoder is set but encode_parameters is not true",
    ),
    "encode-parameters-a-string": (
        _cpu(lambda t: t.__setitem__("encode_parameters", "yes")),
        "targets.cpu.encode_parameters must be true or false",
    ),
}


@pytest.fixture
def specs(tmp_path):
    copy = tmp_path / "specs"
    shutil.copytree(default_specs_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_registry_is_one_line(specs, case):
    mutate, says = CASES[case]
    mutate(specs / "targets.json")
    with pytest.raises(UserError) as info:
        load_registry(specs)
    message = str(info.value)
    assert says in message and "\n" not in message, message
    assert str(specs / "targets.json") in message


def test_comment_fields_are_allowed(specs):
    _cpu(lambda t: t.__setitem__("_note", "tuning notes"))(specs / "targets.json")
    assert "cpu" in load_registry(specs).targets


def test_missing_specs_dir(tmp_path):
    with pytest.raises(UserError, match="specs directory .* does not exist"):
        load_registry(tmp_path / "nope")


def test_compile_with_malformed_specs_is_one_line(specs, tmp_path):
    _truncate(specs / "targets.json")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "sdiree.runtime.cli", "compile", str(tmp_path), "--target", "cpu"]
        + ["--specs", str(specs), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not valid JSON" in lines[0]
    assert not out.exists()


def test_export_choices_match_the_exporters():
    pytest.importorskip("torch")
    from sdiree.compile.exporters.amx_matmul import AMX_OPERANDS, KERNEL_ISAS
    from sdiree.compile.exporters.attention import ATTENTIONS
    from sdiree.compile.exporters.channels_first import TRANSFORMER_CHOICES
    from sdiree.compile.exporters.conv_matmul import CONV_CHOICES, DIRECT_CONVS
    from sdiree.compile.exporters.linear_flat import LINEAR_CHOICES
    from sdiree.compile.exporters.norm_precision import NORM_SUMS
    from sdiree.compile.exporters.vae_channels_last import LAYOUTS
    from sdiree.compile.exporters.winograd import MATMUL_KERNELS, WINOGRAD_OUTPUTS
    from sdiree.compile.exporters.winograd_fused import WINOGRAD_KERNELS
    from sdiree.runtime.registry_schema import EXPORT_CHOICES

    want = {
        "attention": ATTENTIONS, "conv": CONV_CHOICES, "linear": LINEAR_CHOICES,
        "transformer": TRANSFORMER_CHOICES, "winograd_output": WINOGRAD_OUTPUTS,
        "layout": LAYOUTS, "matmul_kernel": MATMUL_KERNELS, "amx_operands": AMX_OPERANDS,
        "kernel_isa": tuple(KERNEL_ISAS), "direct_convs": DIRECT_CONVS,
        "winograd_kernel": WINOGRAD_KERNELS, "norm_sums": NORM_SUMS,
    }  # fmt: skip
    assert want == EXPORT_CHOICES
