"""Text encoder exporter: token ids [B, 77] → last hidden state and pooled output.

Works for CLIPTextModel (SD 1.x/2.x) and CLIPTextModelWithProjection (SDXL's second encoder,
whose pooled output is the projected text_embeds). A second encoder is exported the same way
under its own submodule name and scope.
"""

from __future__ import annotations

import torch

from .base import ExportPlan, FunctionSpec, TensorSpec


class TextEncoderEntry(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor):
        out = self.model(input_ids=input_ids, return_dict=True)
        pooled = out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output
        return out.last_hidden_state, pooled


def plan_text_encoder(
    model: torch.nn.Module,
    *,
    submodule: str,
    batch: int,
    max_length: int,
    dtype: torch.dtype,
    attention: str,
) -> ExportPlan:
    # transformers' eager attention is the decomposed matmul-softmax-matmul form; at 77 tokens
    # its scores are tiny, so `chunked` has nothing to cut and exports it the same way.
    model.set_attn_implementation("sdpa" if attention == "sdpa" else "eager")
    model = model.to(dtype).eval()
    entry = TextEncoderEntry(model)
    dt = {torch.float32: "float32", torch.float16: "float16"}[dtype]
    hidden = model.config.hidden_size
    pooled_dim = (
        getattr(model.config, "projection_dim", hidden)
        if hasattr(model, "text_projection")
        else hidden
    )

    def encode(root, input_ids):
        return root(input_ids)

    return ExportPlan(
        submodule=submodule,
        scope=submodule,
        root=entry,
        params_module=model,
        functions=[
            FunctionSpec(
                name="encode",
                inputs=(TensorSpec("input_ids", (batch, max_length), "int64"),),
                outputs=(
                    TensorSpec("last_hidden_state", (batch, max_length, hidden), dt),
                    TensorSpec("pooled_output", (batch, pooled_dim), dt),
                ),
                fn=encode,
            )
        ],
        options={"attention": attention},
    )
