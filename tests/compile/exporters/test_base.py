"""The export call: non-strict torch.export (the default) writes the same MLIR as strict export."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

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
    from diffusers.models.attention_processor import Attention

    def plan():
        torch.manual_seed(0)
        attn = Attention(16, heads=2, dim_head=8, processor=ChunkedAttnProcessor()).eval()

        def run(root, x):
            return root(x)

        x = TensorSpec("x", (1, 24, 16), "float32")
        fn = FunctionSpec("run", (x,), (x,), run)
        return ExportPlan("attn", "attn", root=attn, params_module=attn, functions=[fn])

    strict, loose = export_both(plan, tmp_path)
    assert strict.count("torch.aten.mm") == 4  # per head: scores and values
    assert strict == loose
