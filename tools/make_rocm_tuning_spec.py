"""Write specs/tuning/rocm_*_convs.mlir, the rocm tuning specs (one per matrix-core family).

rocm fp16 compiles its convolutions channels-last as implicit GEMMs on the matrix cores (MFMA on
CDNA, WMMA on RDNA3), the path AMD's own SDXL builds take. iree 3.13 tiles such a conv 128
output pixels by 64 channels; where the output width is not a multiple of the intrinsic's 16
rows (SD 1.5's 8x8 level at 512², SD 2.1's 24x24 and 12x12 at 768²) it pads the tile, stages
the padded result in shared memory and, when the conv also writes a second (transposed) copy
of its output, needs 80 KiB of the 64 KiB a workgroup has: "uses 81920 bytes of shared memory;
exceeded the limit of 65536 bytes", and the UNet does not compile.

The spec gives exactly those convs (f16 x f16 -> f32, NHWC input, FHWC filter, stride 1 or 2,
output channels a multiple of 64, output width not a multiple of 16) a tile of 64 output
pixels (oh 4, 2 or 1 rows of 16 padded columns) by 64 channels and a K step of 128: 16 KiB per
operand and 16 KiB of staged result, 48 KiB. Convs whose output width is a multiple of 16 match
a first matcher that keeps the compiler's own choice. Matched by indexing maps, element types
and divisibility (`dim_is_multiple_of`), never by size, so every image size and family gets a
valid config. On gfx942 it is linked before IREE's default spec for that chip, which it does
not overlap (that one names attention and matmul shapes of SDXL).

Run: python tools/make_rocm_tuning_spec.py [OUT_DIR]; tests/specs/test_rocm_tuning_spec.py
checks that the shipped files are this script's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tuning_spec_text import APPLY_OP_CONFIG, entrypoint, yield_config

TUNING = Path(__file__).resolve().parent.parent / "specs" / "tuning"

# file stem: (intrinsic, subgroup size, chips)
FAMILIES = {
    "rocm_cdna_convs": ("MFMA_F32_16x16x16_F16", 64, "CDNA2/3 (gfx90a, gfx942)"),
    "rocm_rdna3_convs": ("WMMAR3_F32_16x16x16_F16", 32, "RDNA3 (gfx1100)"),
}

# (layout, stride): indexing maps of the conv and the dims of its output (oh, ow, oc).
# "batched": [n, oh, ow, c] (the UNet's guided call); "single": batch 1 folded away by iree
# (the UNet's unguided call, the VAE).
_B = "(d0, d1, d2, d3, d4, d5, d6)"
_S = "(d0, d1, d2, d3, d4, d5)"
CONVS = {
    ("batched", 1): ([f"{_B} -> (d0, d1 + d4, d2 + d5, d6)", f"{_B} -> (d3, d4, d5, d6)",
                      f"{_B} -> (d0, d1, d2, d3)"], (1, 2, 3)),
    ("batched", 2): ([f"{_B} -> (d0, d1 * 2 + d4, d2 * 2 + d5, d6)", f"{_B} -> (d3, d4, d5, d6)",
                      f"{_B} -> (d0, d1, d2, d3)"], (1, 2, 3)),
    ("single", 1): ([f"{_S} -> (d0 + d3, d1 + d4, d5)", f"{_S} -> (d2, d3, d4, d5)",
                     f"{_S} -> (d0, d1, d2)"], (0, 1, 2)),
    ("single", 2): ([f"{_S} -> (d0 * 2 + d3, d1 * 2 + d4, d5)", f"{_S} -> (d2, d3, d4, d5)",
                     f"{_S} -> (d0, d1, d2)"], (0, 1, 2)),
}  # fmt: skip

# The config's IGEMM loops: [n,] oh, ow, oc, k; the k tile is 8 intrinsic steps of 16 = 128.
ROWS = (4, 2, 1)  # output rows per workgroup, the largest that divides oh
N_TILE, K_STEPS, K_TILE = 64, 8, 128


def _head(name: str, maps: list[str]) -> list[str]:
    return [
        f"transform.named_sequence @{name}(%op: !transform.any_op {{transform.readonly}})",
        "    -> (!transform.any_op, !transform.any_param) {",
        "  transform.iree.match.has_no_lowering_config %op : !transform.any_op",
        "  %batch, %out_img, %out_ch, %filt, %in_ch, %depth, %strides, %dilations =",
        "    transform.iree.match.convolution %op, lhs_type = f16, rhs_type = f16, output_type = f32,",
        "    indexing_maps = [" + ",\n      ".join(f"affine_map<{m}>" for m in maps) + "]",
        "    : !transform.any_op -> !transform.param<i64>",
        "  %out = transform.get_operand %op[2] : (!transform.any_op) -> !transform.any_value",
    ]


def _config(mma: str, subgroup_size: int, rows: int, batched: bool) -> str:
    lead = [1] if batched else []
    wg = [*lead, rows, 16, N_TILE]
    sub = [*lead, min(rows, 2), 1, 2, 0]
    subgroups = (rows // min(rows, 2)) * (N_TILE // 16 // 2)
    zeros = [0] * len(wg)
    return (
        "#iree_codegen.compilation_info<\n"
        "    lowering_config = #iree_gpu.lowering_config<{"
        f"mma_kind = #iree_gpu.mma_layout<{mma}>,\n"
        f"      padding = {[*wg, K_TILE]}, padding_conv = {[*wg, 0, 0, 0]},\n"
        f"      promote_operands = [0, 1], reduction = {[*zeros, K_STEPS]},"
        f" subgroup = {sub}, workgroup = {[*wg, 0]}}}>,\n"
        "    translation_info = #iree_codegen.translation_info<"
        "pipeline = #iree_gpu.pipeline<TileAndFuse>\n"
        f"      workgroup_size = [{subgroups * subgroup_size}, 1, 1]"
        f" subgroup_size = {subgroup_size},\n"
        "      {gpu_pipeline_options = #iree_gpu.pipeline_options<prefetch_num_stages = 2,"
        " no_reduce_shared_memory_bank_conflicts = false, use_igemm_convolution = true>}>>"
    )


def render(stem: str) -> str:
    mma, subgroup_size, chips = FAMILIES[stem]
    out = [
        "// Generated by tools/make_rocm_tuning_spec.py; edit that script, not this file.",
        f"// rocm {chips}: channels-last f16 convs whose output width is not a multiple of 16",
        "// get 64x64 tiles that fit the 64 KiB of shared memory; every other op keeps the",
        "// compiler's own choice.",
        f"module @sdiree_{stem} attributes {{transform.with_named_sequence,",
        "    iree_codegen.tuning_spec_with_default_entrypoint} {",
        "",
        *APPLY_OP_CONFIG,
        "transform.named_sequence @keep_default(%op: !transform.any_op {transform.readonly},",
        "    %unused: !transform.any_param {transform.readonly}) {",
        "  transform.yield",
        "}",
        "",
    ]
    pairs = []
    for (layout, stride), (maps, (oh, ow, oc)) in CONVS.items():
        name = f"match_conv_{layout}_s{stride}_aligned"
        out += _head(name, maps)
        out += [
            f"  transform.iree.match.dim_is_multiple_of %out[{ow}], 16 : !transform.any_value",
            "  %none = transform.param.constant 0 : i64 -> !transform.any_param",
            "  transform.yield %op, %none : !transform.any_op, !transform.any_param",
            "}",
            "",
        ]
        pairs.append((name, "keep_default"))
        for rows in ROWS:
            name = f"match_conv_{layout}_s{stride}_rows{rows}"
            config = _config(mma, subgroup_size, rows, layout == "batched")
            out += _head(name, maps)
            out += [
                f"  transform.iree.match.dim_is_multiple_of %out[{oc}], {N_TILE} : !transform.any_value",
                f"  transform.iree.match.dim_is_multiple_of %out[{oh}], {rows} : !transform.any_value",
                *yield_config(config),
            ]
            pairs.append((name, "apply_op_config"))
    out += entrypoint(pairs)
    return "\n".join(out)


def main(argv: list[str]) -> None:
    out_dir = Path(argv[0]) if argv else TUNING
    for stem in FAMILIES:
        path = out_dir / f"{stem}.mlir"
        path.write_text(render(stem))
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
