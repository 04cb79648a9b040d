"""Text encoder exporter: token embeddings [B, L, D] and EOS positions [B] → hidden states
(the last layer's, or for SDXL's recipe the penultimate layer's, before the final norm) and
pooled output.

The module takes the token embeddings (the rows of the token-embedding table, before position
embeddings are added) instead of token ids, so the runtime can append vectors of its own
(textual-inversion embeddings) without a recompile: it looks the ids up in the table, which
stays in the parameter archive under its state-dict name (`embeddings.token_embedding.weight`,
`text_model.` before it in SDXL's second encoder) though the module no longer reads it. Position
embeddings, the causal mask, the layers and the final norm stay inside, run by transformers' own
forward. The pooled output is the final hidden state at `eos_index` (for SDXL's
CLIPTextModelWithProjection, its projection: `text_embeds`), the position transformers pools
for CLIP's ids: the first end-of-text token. A second encoder is exported the same way under
its own submodule name and scope.
"""

from __future__ import annotations

import torch

from .base import ExportPlan, FunctionSpec, TensorSpec


def clip_text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding `embeddings` (transformers 5's CLIPTextModel itself, the
    `text_model` of 4.x and of CLIPTextModelWithProjection)."""
    return getattr(model, "text_model", model)


# The hidden states a family's recipe takes (specs/families.json `hidden_states`): the index
# into transformers' `hidden_states` tuple (None: `last_hidden_state`, after the final norm),
# and the output's name.
HIDDEN_STATES = {
    "last": (None, "last_hidden_state"),
    "penultimate": (-2, "penultimate_hidden_state"),
}


class TextEncoderEntry(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, hidden_states: str = "last"):
        super().__init__()
        self.model = model
        if hidden_states not in HIDDEN_STATES:
            raise ValueError(f"hidden_states {hidden_states!r}: one of {list(HIDDEN_STATES)}")
        self.layer = HIDDEN_STATES[hidden_states][0]
        eos = int(model.config.eos_token_id)
        if eos <= 0:
            raise ValueError(f"text encoder eos_token_id {eos}: expected a positive id")
        self.eos_token_id = eos
        self._embeds: torch.Tensor | None = None
        # Registered once, not per call: dynamo (strict export) cannot trace a registration.
        clip_text_model(model).embeddings.register_forward_pre_hook(
            self._give_embeds, with_kwargs=True
        )

    def _give_embeds(self, module, args, kwargs):
        if self._embeds is None:  # the model called on its own: ids as usual
            return None
        if args:
            raise RuntimeError("CLIP's embedding layer was called with positional arguments")
        return (), {
            "input_ids": None,
            "position_ids": kwargs.get("position_ids"),
            "inputs_embeds": self._embeds,
        }

    def forward(self, inputs_embeds: torch.Tensor, eos_index: torch.Tensor):
        # transformers' CLIP forward takes only ids, and pools at the first `eos_token_id` (or,
        # for configs with the old eos_token_id 2, at the largest id): ids that are 0 except
        # eos_token_id at eos_index make both rules pick eos_index. The embeddings reach its
        # embedding layer in place of the ids, so its own mask, layers, norm and pooling run.
        positions = torch.arange(inputs_embeds.shape[1], device=eos_index.device)
        pool_ids = (positions[None, :] == eos_index[:, None]).long() * self.eos_token_id
        self._embeds = inputs_embeds
        try:
            if self.layer is None:
                out = self.model(input_ids=pool_ids, return_dict=True)
            else:
                out = self.model(input_ids=pool_ids, output_hidden_states=True, return_dict=True)
        finally:
            self._embeds = None
        pooled = out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output
        hidden = out.last_hidden_state if self.layer is None else out.hidden_states[self.layer]
        return hidden, pooled


def plan_text_encoder(
    model: torch.nn.Module,
    *,
    submodule: str,
    batch: int,
    max_length: int,
    dtype: torch.dtype,
    attention: str,
    hidden_states: str = "last",
    pooled: str = "pooled_output",
) -> ExportPlan:
    # transformers' eager attention is the decomposed matmul-softmax-matmul form; at 77 tokens
    # its scores are tiny, so `chunked` has nothing to cut and exports it the same way. CLIP's
    # head dim is 64 in every SD family, already what `sdpa_pow2` pads to.
    model.set_attn_implementation("sdpa" if attention.startswith("sdpa") else "eager")
    model = model.to(dtype).eval()
    entry = TextEncoderEntry(model, hidden_states)
    dt = {torch.float32: "float32", torch.float16: "float16"}[dtype]
    hidden = model.config.hidden_size
    pooled_dim = (
        getattr(model.config, "projection_dim", hidden)
        if hasattr(model, "text_projection")
        else hidden
    )

    def encode(root, inputs_embeds, eos_index):
        return root(inputs_embeds, eos_index)

    return ExportPlan(
        submodule=submodule,
        scope=submodule,
        root=entry,
        params_module=model,
        functions=[
            FunctionSpec(
                name="encode",
                inputs=(
                    TensorSpec("inputs_embeds", (batch, max_length, hidden), dt),
                    TensorSpec("eos_index", (batch,), "int64"),
                ),
                outputs=(
                    TensorSpec(HIDDEN_STATES[hidden_states][1], (batch, max_length, hidden), dt),
                    TensorSpec(pooled, (batch, pooled_dim), dt),
                ),
                fn=encode,
            )
        ],
        options={"attention": attention},
    )
