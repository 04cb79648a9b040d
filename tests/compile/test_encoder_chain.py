"""An encoder whose chain is split into parts (compile/encoder_chain.py) writes the same bytes
as the encoder as iree-compile wrote it, and the main module reads them."""

from __future__ import annotations

import numpy as np
import pytest

from sdiree.compile.encoder_chain import chain_steps, compile_encoder, split_chain
from sdiree.compile.iree_compile import compile_mlir
from sdiree.compile.param_encoder import encoder_flags, run_encoder
from sdiree.runtime.targets import load_registry

WEIGHTS = 7  # one encoder step each; split below into parts of 2 steps


def _mlir() -> str:
    """main(x) = x + sum_i (w_i^T * (i + 2) + 1): each weight a parameter used only through a
    transform of itself, which IREE hoists into the encoder (one step a weight)."""
    globals_ = "\n".join(
        f'util.global private @w{i} = #flow.parameter.named<"model"::"w{i}"> : tensor<64x32xf32>'
        for i in range(WEIGHTS)
    )
    body = []
    acc = "%x"
    for i in range(WEIGHTS):
        body.append(f"""
  %w{i} = util.global.load @w{i} : tensor<64x32xf32>
  %k{i} = arith.constant {i + 2}.0 : f32
  %t{i} = linalg.generic {{indexing_maps = [affine_map<(i, j) -> (j, i)>, affine_map<(i, j) -> (i, j)>],
       iterator_types = ["parallel", "parallel"]}} ins(%w{i} : tensor<64x32xf32>) outs(%e : tensor<32x64xf32>) {{
  ^bb0(%a: f32, %b: f32):
    %m = arith.mulf %a, %k{i} : f32
    %s = arith.addf %m, %c1 : f32
    linalg.yield %s : f32
  }} -> tensor<32x64xf32>
  %r{i} = linalg.generic {{indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
       iterator_types = ["parallel", "parallel"]}} ins({acc}, %t{i} : tensor<32x64xf32>, tensor<32x64xf32>) outs(%e : tensor<32x64xf32>) {{
  ^bb0(%a: f32, %b: f32, %c: f32):
    %s = arith.addf %a, %b : f32
    linalg.yield %s : f32
  }} -> tensor<32x64xf32>""")
        acc = f"%r{i}"
    return f"""{globals_}
func.func @main(%x: tensor<32x64xf32>) -> tensor<32x64xf32> {{
  %c1 = arith.constant 1.0 : f32
  %e = tensor.empty() : tensor<32x64xf32>{"".join(body)}
  return {acc} : tensor<32x64xf32>
}}
"""


def _flags() -> list[str]:
    return load_registry().target("cpu").compile_flags("x86-64-v3", "fp32")


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    import iree.runtime as rt

    d = tmp_path_factory.mktemp("chain")
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(WEIGHTS)]
    index = rt.ParameterIndex()
    for i, w in enumerate(weights):
        index.add_buffer(f"w{i}", w)
    params = d / "model.irpa"
    index.create_archive_file(str(params))
    src = d / "m.mlir"
    src.write_text(_mlir())
    enc_mlir = d / "enc.mlir"
    compile_mlir(src, d / "main.vmfb", [*_flags(), *encoder_flags(enc_mlir, "m_encoded")],
                 d / "log")  # fmt: skip
    text = enc_mlir.read_text()
    split = split_chain(text, max_steps=2, part_steps=2)
    (d / "split.mlir").write_text(split)
    out = {}
    for name in ("enc", "split"):
        compile_mlir(d / f"{name}.mlir", d / f"{name}.vmfb", _flags(), d / "log")
        count = run_encoder(d / f"{name}.vmfb", [("model", params)], "m_encoded",
                            d / f"{name}.irpa", "local-task")  # fmt: skip
        out[name] = (count, d / f"{name}.irpa")
    return d, weights, params, text, split, out


def test_the_chain_is_split_into_parts_of_the_given_steps(encoders):
    _, _, _, text, split, _ = encoders
    assert chain_steps(text) == WEIGHTS
    # steps 1-2 stay in the encode function; 3-4, 5-6 and 7 go to three parts
    assert split.count("util.func private @__encode_parameters_part") == 3
    assert split.count("util.call @__encode_parameters_part") == 3
    assert split.count("#util.inline.never") == 3
    assert split.count("= stream.resource.dealloca ") == WEIGHTS
    assert split_chain(text, max_steps=WEIGHTS) is text  # short enough: left as written


def test_the_split_encoder_writes_the_same_bytes(encoders):
    _, _, _, _, _, out = encoders
    (count, plain), (split_count, split) = out["enc"], out["split"]
    assert count == split_count >= 1
    assert split.read_bytes() == plain.read_bytes()


def test_the_main_module_reads_what_the_split_encoder_wrote(encoders):
    import iree.runtime as rt

    d, weights, params, _, _, out = encoders
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    want = x + sum(w.T * (i + 2) + 1 for i, w in enumerate(weights))
    instance = rt.VmInstance()
    device = rt.get_driver("local-task").create_default_device()
    providers = []
    for scope, path in (("model", params), ("m_encoded", out["split"][1])):
        index = rt.ParameterIndex()
        index.load(str(path))
        providers.append(index.create_provider(scope=scope))
    module = rt.VmModule.mmap(instance, str(d / "main.vmfb"))
    context = rt.VmContext(instance, modules=[rt.create_io_parameters_module(instance, *providers),
                                              rt.create_hal_module(instance, device), module])  # fmt: skip
    got = np.array(rt.FunctionInvoker(context, device, module.lookup_function("main"))(x).to_host())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def _fake_compiler(fails_above: int | None):
    """A compile_fn that fails on the fixed point while a function holds more than
    fails_above steps (None: never), recording the part sizes it saw."""
    from sdiree.runtime.errors import UserError

    seen = []

    def compile_fn(mlir, vmfb, flags, log):
        text = mlir.read_text()
        parts = text.split("util.func ")
        longest = max(p.count("= stream.resource.dealloca ") for p in parts)
        seen.append(longest)
        if fails_above is not None and longest > fails_above:
            raise UserError(f"iree-compile failed for {mlir.name}: {mlir}:11:1: error: "
                            "maximum iteration count exceeded in fixed point pipeline")  # fmt: skip
        vmfb.write_bytes(b"ok")

    return compile_fn, seen


def test_compile_encoder_splits_long_chains_and_halves_parts_until_it_compiles(
    encoders, tmp_path, monkeypatch
):
    import sdiree.compile.encoder_chain as chain

    _, _, _, text, _, _ = encoders
    path, vmfb = tmp_path / "enc.mlir", tmp_path / "enc.vmfb"
    path.write_text(text)
    fn, seen = _fake_compiler(None)
    assert compile_encoder(path, vmfb, [], tmp_path / "log", fn) == 0  # 7 steps: as written
    assert seen == [WEIGHTS] and path.read_text() == text

    monkeypatch.setattr(chain, "MAX_STEPS", 5)
    monkeypatch.setattr(chain, "PART_STEPS", 6)
    monkeypatch.setattr(chain, "MIN_PART_STEPS", 1)
    fn, seen = _fake_compiler(1)  # only one step a function goes through
    path.write_text(text)
    assert compile_encoder(path, vmfb, [], tmp_path / "log", fn) == 1
    assert seen == [6, 3, 1]  # parts of 6, then 3, then 1
    assert path.read_text().count("util.func private @__encode_parameters_part") == WEIGHTS - 1
    assert not list(tmp_path.glob(".*"))  # no temp left beside it


def test_compile_encoder_tries_a_split_when_a_short_chain_fails(encoders, tmp_path):
    _, _, _, text, _, _ = encoders
    path = tmp_path / "enc.mlir"
    path.write_text(text)
    fn, seen = _fake_compiler(3)
    assert compile_encoder(path, tmp_path / "enc.vmfb", [], tmp_path / "log", fn) == 3
    assert seen == [WEIGHTS, 3]  # as written first, then parts of half the chain


def test_compile_encoder_gives_up_with_the_compilers_line(encoders, tmp_path, monkeypatch):
    import sdiree.compile.encoder_chain as chain
    from sdiree.runtime.errors import UserError

    _, _, _, text, _, _ = encoders
    path = tmp_path / "enc.mlir"
    path.write_text(text)
    monkeypatch.setattr(chain, "MIN_PART_STEPS", 2)
    fn, seen = _fake_compiler(0)  # never compiles
    with pytest.raises(UserError, match="fixed point pipeline"):
        compile_encoder(path, tmp_path / "enc.vmfb", [], tmp_path / "log", fn)
    assert seen == [WEIGHTS, 3, 1]  # as written, halves, and no part under the minimum
    # a failure that is not the fixed point is not retried
    path.write_text(text)
    calls = []

    def broken(mlir, vmfb, flags, log):
        calls.append(1)
        raise UserError("iree-compile failed for enc.mlir: error: something else")

    with pytest.raises(UserError, match="something else"):
        compile_encoder(path, tmp_path / "enc.vmfb", [], tmp_path / "log", broken)
    assert calls == [1]


def test_a_module_it_cannot_split_is_compiled_as_written(tmp_path):
    from sdiree.runtime.errors import UserError

    path = tmp_path / "enc.mlir"
    path.write_text("module @encoder {\n}\n")  # no encode function
    fn, seen = _fake_compiler(-1)  # fails on the fixed point whatever it gets
    with pytest.raises(UserError, match="fixed point"):
        compile_encoder(path, tmp_path / "enc.vmfb", [], tmp_path / "log", fn)
    assert len(seen) == 1 and path.read_text() == "module @encoder {\n}\n"


def test_a_chain_of_another_shape_is_refused(encoders):
    from sdiree.compile.encoder_chain import ChainError

    _, _, _, text, _, _ = encoders
    # a later step that reads the function's argument (not a copyable constant) cannot move
    lines = text.split("\n")
    last = max(i for i, ln in enumerate(lines) if "= stream.resource.dealloca " in ln)
    lines.insert(last, "    %late = stream.timepoint.import on(#hal.device.promise<@__device_0>) "
                 "%arg1 : (!hal.fence) => !stream.timepoint")  # fmt: skip
    with pytest.raises(ChainError, match="%arg1"):
        split_chain("\n".join(lines), max_steps=2, part_steps=2)
