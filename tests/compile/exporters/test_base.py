"""The export call: non-strict torch.export (the default) writes the same MLIR as strict export,
and one trace with the decompositions applied while tracing (the default) gives iree-compile the
same input as turbine's two traces."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from export_parity import compiler_input  # noqa: E402  (tools/ is on sys.path: tests/conftest.py)

from sdiree.compile.exporters.attention import ChunkedAttnProcessor  # noqa: E402
from sdiree.compile.exporters.base import (  # noqa: E402
    ExportPlan,
    FunctionSpec,
    TensorSpec,
    export_to_mlir,
)
from sdiree.compile.exporters.text_encoder import plan_text_encoder  # noqa: E402


def mlir_text(path) -> str:
    """The module as text, without source locations (they name the tracing mode's frames)."""
    from iree.compiler import ir

    with ir.Context():
        return str(ir.Module.parse(path.read_bytes()))


def export_both(make_plan, tmp_path) -> tuple[str, str]:
    texts = []
    for strict in (True, False):
        path = tmp_path / f"strict-{strict}.mlirbc"
        export_to_mlir(make_plan(), path, strict=strict)  # a fresh model each time
        texts.append(mlir_text(path))
    return texts[0], texts[1]


def test_text_encoder_exports_the_same_either_way(tiny_model, tmp_path):
    from transformers import CLIPTextModel

    def plan():
        model = CLIPTextModel.from_pretrained(tiny_model / "text_encoder")
        return plan_text_encoder(
            model,
            submodule="text_encoder",
            batch=1,
            max_length=77,
            dtype=torch.float32,
            attention="chunked",
        )

    strict, loose = export_both(plan, tmp_path)
    assert '#flow.parameter.named<"text_encoder"::' in strict  # parameters stay external
    assert strict == loose


def test_chunked_attention_exports_the_same_either_way(tmp_path):
    """diffusers' Attention with the chunked processor: a Python loop over heads."""
    strict, loose = export_both(attention_plan, tmp_path)
    assert strict.count("torch.aten.mm") == 4  # per head: scores and values
    assert strict == loose


def export_traced_once_and_twice(make_plan, tmp_path) -> tuple[str, str]:
    paths = []
    for one in (True, False):
        path = tmp_path / f"one-trace-{one}.mlirbc"
        export_to_mlir(make_plan(), path, one_trace=one)
        paths.append(path)
    # the torch-level graphs are not the same text (the checks, and SSA names after them)
    assert "_assert_tensor_metadata" in mlir_text(paths[1])
    assert "_assert_tensor_metadata" not in mlir_text(paths[0])
    return compiler_input(paths[0]), compiler_input(paths[1])


def test_one_trace_gives_iree_the_same_text_encoder(tiny_model, tmp_path):
    """Linears and layer norms: composites turbine's table keeps (aten.linear) or decomposes
    (native_layer_norm), and the embedding's lookups."""
    from transformers import CLIPTextModel

    def plan():
        model = CLIPTextModel.from_pretrained(tiny_model / "text_encoder")
        return plan_text_encoder(
            model, submodule="text_encoder", batch=1, max_length=77, dtype=torch.float32,
            attention="chunked",
        )  # fmt: skip

    once, twice = export_traced_once_and_twice(plan, tmp_path)
    assert "linalg.matmul" in once or "linalg.batch_matmul" in once
    assert once == twice


def test_one_trace_gives_iree_the_same_winograd_vae_decoder(tmp_path):
    """The cpu presets' decoder: channels-last, F(4x4,3x3) Winograd convs (thousands of
    slices, adds and matmuls) and the mid attention's aten.group_norm, a composite that
    decomposed while traced would become index gathers unless kept as run_decompositions
    keeps it."""
    from diffusers import AutoencoderKL

    from sdiree.compile.exporters.vae import plan_vae_decoder

    def plan():
        torch.manual_seed(0)
        model = AutoencoderKL(
            block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
            latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
        ).eval()  # fmt: skip
        return plan_vae_decoder(
            model, batch=1, image_hw=(16, 16), dtype=torch.float32, attention="chunked",
            conv="winograd4", layout="channels_last",
        )  # fmt: skip

    once, twice = export_traced_once_and_twice(plan, tmp_path)
    assert once.count("linalg.matmul") + once.count("linalg.batch_matmul") > 20
    assert once == twice


def attention_plan() -> ExportPlan:
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    attn = Attention(16, heads=2, dim_head=8, processor=ChunkedAttnProcessor()).eval()

    def run(root, x):
        return root(x)

    x = TensorSpec("x", (1, 24, 16), "float32")
    fn = FunctionSpec("run", (x,), (x,), run)
    return ExportPlan("attn", "attn", root=attn, params_module=attn, functions=[fn])


def test_a_torch_without_the_private_functions_traces_twice(tmp_path, monkeypatch):
    """Where torch lacks what one trace needs, export_to_mlir runs turbine's two traces (the
    training graph's metadata checks stay); torch.export.export is left as it was either way."""
    import torch.export._trace as trace

    export = torch.export.export
    path = tmp_path / "once.mlirbc"
    export_to_mlir(attention_plan(), path)
    assert "_assert_tensor_metadata" not in mlir_text(path)
    assert torch.export.export is export

    to_aten = trace._export_to_aten_ir  # as if it took no decomposition table
    monkeypatch.setattr(trace, "_export_to_aten_ir", lambda *a, **k: to_aten(*a, **k))
    path = tmp_path / "twice.mlirbc"
    export_to_mlir(attention_plan(), path)
    assert "_assert_tensor_metadata" in mlir_text(path)
    assert torch.export.export is export
