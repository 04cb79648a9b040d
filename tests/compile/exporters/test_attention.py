"""Attention export choices: chunked attention is softmax attention, in torch and through iree."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.attention import (  # noqa: E402
    SCORE_BLOCK_BYTES,
    chunked_attention,
    pow2_dim,
    query_block,
    set_attention,
)

REASSOCIATE = "--iree-llvmcpu-reassociate-fp-reductions=true"


class OneAttention(torch.nn.Module):
    """One diffusers Attention layer as a model (set_attention walks a model's layers)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def set_attn_processor(self, processor):
        self.attn.set_processor(processor)

    def forward(self, x, context=None):
        return self.attn(x, context)


def reference(q, k, v, scale, mask=None):
    s = q.double() @ k.double().transpose(1, 2) * scale
    if mask is not None:
        s = s + mask.double()
    return (s.softmax(-1) @ v.double()).float()


def test_query_block_halves_queries_until_one_head_fits():
    # SD 1.5 at 512x512, fp32: 4096 queries x 4096 keys -> blocks of 1024 queries (16 MiB)
    assert query_block(4096, 4096, 4, SCORE_BLOCK_BYTES) == 1024
    assert query_block(1024, 1024, 4, SCORE_BLOCK_BYTES) == 1024  # 32x32 latents: one block
    assert query_block(4096, 77, 4, SCORE_BLOCK_BYTES) == 4096  # cross-attention
    assert query_block(4096, 4096, 2, SCORE_BLOCK_BYTES) == 2048  # half precision
    assert query_block(50, 50, 4, 256) == 25  # stops at odd sizes, however small the budget


@pytest.mark.parametrize("mask_rows", [None, 1, 24], ids=["no-mask", "key-mask", "full-mask"])
def test_chunked_attention_is_softmax_attention(mask_rows):
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 24, 8), torch.randn(4, 20, 8), torch.randn(4, 20, 8)
    mask = None if mask_rows is None else torch.randn(4, mask_rows, 20)
    budget = 12 * 20 * 4  # blocks of 12 queries: 4 heads x 2 blocks
    assert query_block(24, 20, 4, budget) == 12
    got = chunked_attention(q, k, v, 0.35, mask, budget=budget)
    torch.testing.assert_close(got, reference(q, k, v, 0.35, mask), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("pad_keys", [False, True], ids=["pow2", "pow2-keys"])
@pytest.mark.parametrize("keys,dim", [(64, 40), (77, 80), (64, 64)], ids=["40", "cross", "64"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_pow2_processor_is_softmax_attention(keys, dim, pad_keys, masked):
    from sdiree.compile.exporters.attention import Pow2KeysSdpaProcessor, Pow2SdpaProcessor

    torch.manual_seed(0)
    q, k, v = torch.randn(4, 24, dim), torch.randn(4, keys, dim), torch.randn(4, keys, dim)
    mask = torch.randn(4, 1, keys) if masked else None
    proc = Pow2KeysSdpaProcessor() if pad_keys else Pow2SdpaProcessor()
    got = proc.attend(q, k, v, dim**-0.5, mask)
    torch.testing.assert_close(got, reference(q, k, v, dim**-0.5, mask), atol=2e-6, rtol=1e-5)


def test_pow2_dim():
    assert [pow2_dim(d) for d in (8, 40, 64, 80, 128, 160)] == [64, 64, 64, 128, 128, 256]


@pytest.mark.parametrize("choice", ["chunked", "sdpa_pow2", "sdpa_pow2_keys"])
def test_processor_matches_diffusers_in_a_unet_and_a_vae(tiny_model, choice):
    """Every diffusers attention layer kind SD uses (self, cross, the VAE's group-norm one)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet").eval()
    vae = AutoencoderKL.from_pretrained(tiny_model / "vae").eval()
    sample = torch.randn(2, unet.config.in_channels, 8, 8)
    text = torch.randn(2, 77, unet.config.cross_attention_dim)
    latents = torch.randn(1, vae.config.latent_channels, 8, 8)

    def run():
        with torch.no_grad():
            return unet(sample, 10.0, text).sample, vae.decode(latents).sample

    for model in (unet, vae):
        set_attention(model, "decomposed")
    want = run()
    for model in (unet, vae):
        set_attention(model, choice)
    got = run()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_chunked_block_budget_is_the_export_choice():
    """`attention_block_bytes` reaches every chunked layer: with a budget of 12 queries' scores
    the processor cuts 24 queries into two blocks, two 2-D matmul pairs per head, and still
    computes softmax attention; without it, the default budget (one block)."""
    from diffusers.models.attention_processor import Attention

    from sdiree.compile.exporters.attention import ChunkedAttnProcessor

    torch.manual_seed(0)
    model = OneAttention(Attention(16, heads=2, dim_head=8)).eval()
    x = torch.randn(1, 24, 16)
    with torch.no_grad():
        want = model(x)

    def traced_mms(block_bytes):
        set_attention(model, "chunked", block_bytes)
        proc = model.attn.processor
        assert isinstance(proc, ChunkedAttnProcessor)
        assert proc.block_bytes == (block_bytes or SCORE_BLOCK_BYTES)
        with torch.no_grad():
            torch.testing.assert_close(model(x), want, atol=2e-6, rtol=1e-5)
        graph = torch.export.export(model, (x,), strict=False).graph
        return sum(n.target == torch.ops.aten.mm.default for n in graph.nodes)

    # q, k, v and out projections are linears (addmm/mm by shape); attention's are 2 per block
    base = traced_mms(None)
    assert traced_mms(12 * 24 * 4) == base + 2 * 2  # 2 heads x 1 more block x 2 matmuls


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="unknown attention export choice 'flash'"):
        set_attention(torch.nn.Module(), "flash")


@pytest.mark.parametrize("reassociate", [False, True], ids=["in-order", "reassociated"])
def test_compiled_chunked_attention_matches_torch(reassociate):
    """Several blocks through iree's llvm-cpu with the cpu target's data tiling and ukernels,
    and with the UNet's `--iree-llvmcpu-reassociate-fp-reductions` (the row max then reduced
    lane by lane, compile/NOTES.md).

    Each head is traced as 2-D matmuls (iree runs those faster than batch-1 batch_matmuls)."""
    import numpy as np
    from iree.turbine import aot
    from llvm_cpu import DATA_TILING, run_main

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return chunked_attention(q, k, v, 0.2, budget=64 * 128 * 4)  # 4 heads x 4 blocks

    torch.manual_seed(0)
    q, k, v = torch.randn(4, 256, 40), torch.randn(4, 128, 40), torch.randn(4, 128, 40)
    mlir = str(aot.export(Attn(), args=(q, k, v)).mlir_module)
    assert mlir.count("torch.aten.mm ") == 2 * 4 * 4 and "torch.aten.bmm" not in mlir
    flags = (*DATA_TILING, *([REASSOCIATE] if reassociate else []))
    if reassociate:  # the flag this test stands for is the cpu preset's
        from sdiree.runtime.targets import load_registry

        assert REASSOCIATE in load_registry().target("cpu").compile_flags("host", "fp32", "unet")
    got = run_main(mlir, q.numpy(), k.numpy(), v.numpy(), flags=flags)
    np.testing.assert_allclose(got, reference(q, k, v, 0.2).numpy(), atol=1e-5)


@pytest.mark.parametrize(
    "target,arch,intrinsic",
    [("cuda", "sm_80", "NV_MMA_SYNC"), ("rocm", "gfx942", "MFMA"), ("rocm", "gfx1100", "WMMA")],
)
@pytest.mark.parametrize(
    "choice,keys,tensor_cores",
    [
        ("sdpa", 256, False),
        ("sdpa_pow2", 256, True),
        ("sdpa_pow2", 77, False),
        ("sdpa_pow2_keys", 77, True),
    ],
)
def test_gpu_attention_gets_matrix_cores_only_padded(
    target, arch, intrinsic, choice, keys, tensor_cores
):
    """SD 1.5's 40-wide heads: iree's own configuration of the fused attention op, for the
    registry's fp16 flags of each GPU target, has a matrix-core schedule (NV_MMA_SYNC, MFMA,
    WMMA) only with the head dim padded to a power of two, as the registry exports it, and over
    77 text tokens only with the keys padded too (sdpa_pow2_keys)."""
    from diffusers.models.attention_processor import Attention
    from iree.compiler import compile_str
    from iree.turbine import aot

    from sdiree.runtime.targets import load_registry

    gpu = load_registry().target(target)
    assert gpu.export_for("unet", "fp16", arch)["attention"] == "sdpa_pow2_keys"
    # the VAE's one head is 512 wide, a power of two already; sdpa_pow2 would only upcast its
    # softmax-upcast layer to an fp32 fused op (slower on an H200: tools/PERFORMANCE.md)
    assert gpu.export_for("vae_decoder", "fp16", arch)["attention"] == "sdpa"

    model = OneAttention(Attention(320, heads=8, dim_head=40)).half().eval()
    set_attention(model, choice)
    x = torch.randn(1, 256, 320, dtype=torch.float16)
    context = torch.randn(1, keys, 320, dtype=torch.float16)
    mlir = str(aot.export(model, args=(x, context)).mlir_module)
    flags = [*gpu.compile_flags(arch, "fp16", "unet"), "--compile-to=executable-configurations"]
    out = compile_str(mlir, extra_args=flags).decode()
    funcs = re.split(r"\n\s*func\.func @", out)[1:]
    attention = [f for f in funcs if re.match(r"\S*attention", f)]
    assert len(attention) == 1, [f.split("(")[0] for f in funcs]
    assert (f"mma_kind = #iree_gpu.mma_layout<{intrinsic}" in attention[0]) == tensor_cores
