"""The parameter encoder: weight transforms computed once at compile time give the same results
as the module computing them at load, and the encoded archive is what the module then reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sdiree.compile.iree_compile import compile_mlir
from sdiree.compile.param_encoder import encoder_flags, run_encoder
from sdiree.runtime.targets import load_registry

# A weight used only through a transform of itself (w * 2 + 1, then a transpose): a const-expr
# that IREE hoists out of `main`, as it does with the UNet's packed and Winograd weights.
MLIR = """
util.global private @w = #flow.parameter.named<"model"::"w"> : tensor<64x32xf32>
func.func @main(%x: tensor<32x64xf32>) -> tensor<32x64xf32> {
  %w = util.global.load @w : tensor<64x32xf32>
  %c2 = arith.constant 2.0 : f32
  %c1 = arith.constant 1.0 : f32
  %e = tensor.empty() : tensor<32x64xf32>
  %t = linalg.generic {indexing_maps = [affine_map<(i, j) -> (j, i)>, affine_map<(i, j) -> (i, j)>],
       iterator_types = ["parallel", "parallel"]} ins(%w : tensor<64x32xf32>) outs(%e : tensor<32x64xf32>) {
  ^bb0(%a: f32, %b: f32):
    %m = arith.mulf %a, %c2 : f32
    %s = arith.addf %m, %c1 : f32
    linalg.yield %s : f32
  } -> tensor<32x64xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
       iterator_types = ["parallel", "parallel"]} ins(%x, %t : tensor<32x64xf32>, tensor<32x64xf32>) outs(%e : tensor<32x64xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %s = arith.addf %a, %b : f32
    linalg.yield %s : f32
  } -> tensor<32x64xf32>
  return %r : tensor<32x64xf32>
}
"""


def _flags() -> list[str]:
    cpu = load_registry().target("cpu")
    return cpu.compile_flags("x86-64-v3", "fp32")


def _archive(path: Path, weight: np.ndarray) -> Path:
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.add_buffer("w", weight)
    index.create_archive_file(str(path))
    return path


def _run(vmfb: Path, archives: list[tuple[str, Path]], x: np.ndarray) -> np.ndarray:
    import iree.runtime as rt

    instance = rt.VmInstance()
    device = rt.get_driver("local-task").create_default_device()
    providers = []
    for scope, path in archives:
        index = rt.ParameterIndex()
        index.load(str(path))
        providers.append(index.create_provider(scope=scope))
    module = rt.VmModule.mmap(instance, str(vmfb))
    context = rt.VmContext(
        instance,
        modules=[
            rt.create_io_parameters_module(instance, *providers),
            rt.create_hal_module(instance, device),
            module,
        ],
    )
    main = rt.FunctionInvoker(context, device, module.lookup_function("main"))
    return np.array(main(x).to_host())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("encoder")
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 32)).astype(np.float32)
    params = _archive(d / "model.irpa", weight)
    src = d / "m.mlir"
    src.write_text(MLIR)
    plain, main, enc_mlir = d / "plain.vmfb", d / "main.vmfb", d / "enc.mlir"
    compile_mlir(src, plain, _flags(), d / "log")
    compile_mlir(src, main, [*_flags(), *encoder_flags(enc_mlir, "m_encoded")], d / "log")
    compile_mlir(enc_mlir, d / "enc.vmfb", _flags(), d / "log")
    count = run_encoder(
        d / "enc.vmfb", [("model", params)], "m_encoded", d / "enc.irpa", "local-task"
    )
    return d, weight, params, count


def test_encoder_output_is_the_transformed_weight(built):
    d, weight, params, count = built
    assert count >= 1
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load(str(d / "enc.irpa"))
    blobs = [rt.parameter_index_entry_as_numpy_flat_ndarray(e) for _, e in index.items()]
    expected = (weight.T * 2 + 1).astype(np.float32)
    # Whatever layout IREE picked, the transformed values are in the archive, not the raw ones.
    data = np.concatenate(blobs).view(np.float32)
    assert np.isin(expected.ravel(), data).all()
    assert not np.isin(weight.ravel(), data).all()


def test_main_module_reads_the_encoded_archive(built):
    d, weight, params, _ = built
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    want = x + weight.T * 2 + 1
    plain = _run(d / "plain.vmfb", [("model", params)], x)
    encoded = _run(d / "main.vmfb", [("model", params), ("m_encoded", d / "enc.irpa")], x)
    np.testing.assert_allclose(plain, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(encoded, plain)
    # The encoded module really reads the archive: a zeroed one gives x back, not the result.
    zero = d / "zero.irpa"
    import iree.runtime as rt

    src = rt.ParameterIndex()
    src.load(str(d / "enc.irpa"))
    z = rt.ParameterIndex()
    for key, entry in src.items():
        z.add_buffer(key, np.zeros(entry.length, np.uint8))
    z.create_archive_file(str(zero))
    stale = _run(d / "main.vmfb", [("model", params), ("m_encoded", zero)], x)
    assert np.abs(stale - want).max() > 1.0


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps")
def test_the_encoder_maps_its_inputs_and_writes_its_output_through_a_handle(
    built, tmp_path, monkeypatch
):
    """On cpu the encoder's inputs are mapped (read through handles, each step's parameter went
    into newly faulted transient pages: SD 1.5's UNet encoder 33.4 s against 9.8) and its
    output written through a file handle (a writable mapping held ~10 GiB of dirty pages). Its
    output is the same bytes as the encoder writes into given buffers."""
    import shutil

    import iree.runtime as rt

    from sdiree.runtime.session import parameter_providers
    from sdiree.runtime.weights import encoder as encoder_module

    d, _, params, _ = built
    shutil.copy(params, tmp_path / "model.irpa")
    mapped_during_encode = []
    real_encode = encoder_module._encode

    def spying_encode(functions, ctx, device):
        maps = Path("/proc/self/maps").read_text().splitlines()
        mapped_during_encode.extend(line for line in maps if str(tmp_path) in line)
        real_encode(functions, ctx, device)

    monkeypatch.setattr(encoder_module, "_encode", spying_encode)
    out = tmp_path / "enc.irpa"
    count = run_encoder(
        d / "enc.vmfb", [("model", tmp_path / "model.irpa")], "m_encoded", out, "local-task"
    )
    assert count >= 1
    assert any(line.endswith("/model.irpa") for line in mapped_during_encode)
    assert not any("enc" in line.rsplit("/", 1)[-1] for line in mapped_during_encode)

    written = rt.ParameterIndex()
    written.load(str(out))
    device = rt.get_driver("local-task").create_default_device()
    into = {k: np.zeros(e.length, np.uint8) for k, e in written.items() if not e.is_splat}
    providers = parameter_providers([("model", params)])
    encoder_module.run_encoder(d / "enc.vmfb", providers, "m_encoded", None, device, into=into)
    for key, buf in into.items():
        got = rt.parameter_index_entry_as_numpy_flat_ndarray(dict(written.items())[key])
        np.testing.assert_array_equal(got, buf)


def test_nothing_to_encode_writes_no_encoder(tmp_path):
    """The driver relies on this: no hoisted weights, no encoder module, no encoded archive."""
    src = tmp_path / "id.mlir"
    src.write_text(
        "func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> { return %x : tensor<4xf32> }\n"
    )
    enc = tmp_path / "enc.mlir"
    compile_mlir(src, tmp_path / "m.vmfb", [*_flags(), *encoder_flags(enc, "s")], tmp_path / "log")
    assert (tmp_path / "m.vmfb").is_file()
    assert not enc.exists()
