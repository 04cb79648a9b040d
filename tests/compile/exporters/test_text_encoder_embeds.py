"""The text encoder exported on token embeddings: the same outputs as transformers on the ids
those embeddings come from, for CLIPTextModel and SDXL's CLIPTextModelWithProjection, in torch
and compiled by IREE; the token table stays in the parameter archive, unread by the module."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.base import export_to_mlir, save_parameters  # noqa: E402
from sdiree.compile.exporters.text_encoder import (  # noqa: E402
    TextEncoderEntry,
    clip_text_model,
    plan_text_encoder,
)

VOCAB, BOS, EOS = 100, 98, 99


def tiny_clip(cls_name: str, eos_token_id: int, width: int = 32):
    import transformers

    config = transformers.CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=16 if width == 32 else width,
        bos_token_id=BOS,
        eos_token_id=eos_token_id,
        pad_token_id=EOS,
    )
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config).eval()


def prompt_ids(batch: int = 2, length: int = 77) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids as the tokenizer pads them (start, words, end, end...) and the end's positions."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, BOS, (batch, length), generator=g)
    ids[:, 0] = BOS
    ends = torch.tensor([5 + 13 * i for i in range(batch)])
    for row, end in enumerate(ends.tolist()):
        ids[row, end:] = EOS
    return ids, ends


def pooled_of(out):
    return out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output


CASES = [
    ("CLIPTextModel", EOS),
    ("CLIPTextModel", 2),  # the old eos_token_id: transformers pools at the largest id
    ("CLIPTextModelWithProjection", EOS),
    ("CLIPTextModelWithProjection", 2),
]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(("cls_name", "eos_token_id"), CASES)
def test_entry_on_looked_up_embeddings_is_transformers_on_ids(cls_name, eos_token_id, attention):
    model = tiny_clip(cls_name, eos_token_id)
    model.set_attn_implementation(attention)
    ids, ends = prompt_ids()
    table = clip_text_model(model).embeddings.token_embedding.weight
    with torch.no_grad():
        ref = model(input_ids=ids)
        hidden, pooled = TextEncoderEntry(model)(table[ids], ends)
    assert torch.equal(hidden, ref.last_hidden_state)
    assert torch.equal(pooled, pooled_of(ref))
    if cls_name.endswith("WithProjection"):
        assert pooled.shape == (2, 16)


def test_pooled_output_follows_eos_index_not_the_ids():
    """A new token's id past the vocabulary would win transformers' argmax under eos_token_id
    2; the module pools at the position it is given."""
    model = tiny_clip("CLIPTextModel", 2)
    ids, ends = prompt_ids()
    table = clip_text_model(model).embeddings.token_embedding.weight
    with torch.no_grad():
        hidden, pooled = TextEncoderEntry(model)(table[ids], ends)
        _, moved = TextEncoderEntry(model)(table[ids], ends - 1)
    assert torch.equal(pooled, hidden[torch.arange(2), ends])
    assert torch.equal(moved, hidden[torch.arange(2), ends - 1])


def test_plan_declares_embeddings_and_eos_index(tiny_model):
    from transformers import CLIPTextModel

    model = CLIPTextModel.from_pretrained(tiny_model / "text_encoder")
    plan = plan_text_encoder(
        model,
        submodule="text_encoder",
        batch=1,
        max_length=77,
        dtype=torch.float16,
        attention="chunked",
    )
    sig = plan.signature_json()["encode"]
    assert sig["inputs"] == [
        {"name": "inputs_embeds", "shape": [1, 77, 32], "dtype": "float16"},
        {"name": "eos_index", "shape": [1], "dtype": "int64"},
    ]
    assert [o["name"] for o in sig["outputs"]] == ["last_hidden_state", "pooled_output"]
    assert "embeddings.token_embedding.weight" in plan.params_module.state_dict()


def _run_compiled(vmfb: bytes, irpa, scope: str, *args: np.ndarray) -> list[np.ndarray]:
    import iree.runtime as rt

    config = rt.Config("local-task")
    index = rt.ParameterIndex()
    index.load(str(irpa))
    ctx = rt.SystemContext(
        vm_modules=[
            rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope=scope)),
            rt.create_hal_module(config.vm_instance, config.device),
            rt.VmModule.copy_buffer(config.vm_instance, vmfb),
        ],
        config=config,
    )
    results = ctx.modules.text_encoder_2.encode(*args)
    return [np.array(r.to_host()) for r in results]


@pytest.mark.parametrize(
    "cls_name,linear",
    [
        ("CLIPTextModel", "native"),
        ("CLIPTextModelWithProjection", "native"),
        # 64 wide: every Linear (the projection's too) on sdiree's fp32 kernel, as cpu fp32 on
        # an AVX-512 CPU without AMX exports it (specs/targets.json); run where this CPU has
        # AVX-512, else cross-compiled for a Zen 4 and not run
        ("CLIPTextModelWithProjection", "f32"),
    ],
)
def test_compiled_module_matches_transformers_and_leaves_the_table_unread(
    cls_name, linear, tmp_path
):
    from iree.compiler import compile_file

    from sdiree.compile.exporters.linear_f32 import CPU_FEATURES
    from sdiree.compile.exporters.linear_flat import set_linear_lowering
    from sdiree.runtime.cpu_features import host_cpu_features

    model = tiny_clip(cls_name, EOS, width=64 if linear == "f32" else 32)
    ids, ends = prompt_ids(batch=2)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert set_linear_lowering(model, linear) == linears  # every one fits the kernel
    with torch.no_grad():
        ref = model(input_ids=ids)
    plan = plan_text_encoder(
        model,
        submodule="text_encoder_2",
        batch=2,
        max_length=77,
        dtype=torch.float32,
        attention="chunked",
    )
    mlir, irpa = tmp_path / "te.mlirbc", tmp_path / "te.irpa"
    export_to_mlir(plan, mlir)
    save_parameters(plan.params_module, irpa)
    text = _mlir_text(mlir)
    table_name = next(k for k in model.state_dict() if k.endswith("token_embedding.weight"))
    positions = table_name.replace("token_embedding", "position_embedding")
    assert f'"text_encoder_2"::"{table_name}"' not in text  # the runtime looks ids up itself
    assert f'"text_encoder_2"::"{positions}"' in text  # positions are still added inside

    assert ("flow.dispatch @sdiree_f32_linear_" in text) == (linear == "f32")
    table = clip_text_model(model).embeddings.token_embedding.weight.detach().numpy()
    runs = linear != "f32" or set(CPU_FEATURES) <= host_cpu_features()
    vmfb = compile_file(
        str(mlir),
        target_backends=["llvm-cpu"],
        extra_args=[f"--iree-llvmcpu-target-cpu={'host' if runs else 'znver4'}"],
    )
    if not runs:
        assert b"sdiree_f32_linear_workgroup" in vmfb
        return
    hidden, pooled = _run_compiled(vmfb, irpa, "text_encoder_2", table[ids.numpy()], ends.numpy())
    want_hidden = ref.last_hidden_state.numpy()
    want_pooled = pooled_of(ref).numpy()
    assert np.abs(hidden - want_hidden).max() <= 1e-5 * np.abs(want_hidden).max() + 1e-6
    assert np.abs(pooled - want_pooled).max() <= 1e-5 * np.abs(want_pooled).max() + 1e-6


def _mlir_text(path) -> str:
    from iree.compiler import ir

    with ir.Context():
        return str(ir.Module.parse(path.read_bytes()))
