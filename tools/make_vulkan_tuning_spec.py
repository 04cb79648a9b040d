"""Write specs/tuning/vulkan_coopmatrix_fallback.mlir, the vulkan-spirv tuning spec.

iree 3.13's cooperative-matrix (tensor core) codegen for Vulkan picks its pipeline for every
f16 x f16 -> f32 contraction whose sizes fit an intrinsic, then fails on some of them ("no GPU
subgroup mma compute ops generated"):
- contractions whose result is stored transposed, N before M (the 1x1 convolutions and the
  transformers' proj_in/proj_out of SD 1.x, read channels-last and written NCHW);
- attention's batch matmuls: Q.K^T with K transposed (the UNet) or not (the VAE), whose scale
  is fused after them, at every size where it picked them, and P.V where N (the head dim, 40 in
  SD 1.x) is a multiple of 8 but not of 16 (NVIDIA's 16x8x16 intrinsic). P.V and the VAE's Q.K^T
  have the same indexing maps, so both go to SIMT.
The spec sends those contractions to the SIMT matmul pipeline (MatmulPromoteVectorize) and
leaves every other contraction (the linear layers, the 3x3 convolutions) on cooperative
matrices. Each class is matched by its indexing maps and element types,
never by its sizes; the tile is the largest of 64/16/8 that divides M, N and K (checked by
matchers), so any image size and model family gets a valid config.

Run: python tools/make_vulkan_tuning_spec.py [OUT]; tests/specs/test_tuning_specs.py checks that
the shipped file is this script's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tuning_spec_text import APPLY_OP_CONFIG, entrypoint, yield_config

SPEC = (
    Path(__file__).resolve().parent.parent / "specs" / "tuning" / "vulkan_coopmatrix_fallback.mlir"
)

# name: (indexing maps, role of each loop dim, {role: (operand, dim)} for the divisibility checks).
# Roles: b batch (tile 1), m, n, k, o an outer M dim (tile 1).
CLASSES = {
    "nt_out_2d_kmajor": (
        ["(d0, d1, d2) -> (d2, d1)", "(d0, d1, d2) -> (d0, d2)", "(d0, d1, d2) -> (d0, d1)"],
        "nmk",
        {"m": (0, 1), "k": (0, 0), "n": (1, 0)},
    ),
    "nt_out_2d": (
        ["(d0, d1, d2) -> (d1, d2)", "(d0, d1, d2) -> (d0, d2)", "(d0, d1, d2) -> (d0, d1)"],
        "nmk",
        {"m": (0, 0), "k": (0, 1), "n": (1, 0)},
    ),
    "nt_out_batch_kmajor": (
        [
            "(d0, d1, d2, d3) -> (d0, d3, d2)",
            "(d0, d1, d2, d3) -> (d1, d3)",
            "(d0, d1, d2, d3) -> (d0, d1, d2)",
        ],
        "bnmk",
        {"m": (0, 2), "k": (0, 1), "n": (1, 0)},
    ),
    "nt_out_batch": (
        [
            "(d0, d1, d2, d3) -> (d0, d2, d3)",
            "(d0, d1, d2, d3) -> (d1, d3)",
            "(d0, d1, d2, d3) -> (d0, d1, d2)",
        ],
        "bnmk",
        {"m": (0, 1), "k": (0, 2), "n": (1, 0)},
    ),
    "nt_out_2m_kmajor": (
        [
            "(d0, d1, d2, d3) -> (d3, d1, d2)",
            "(d0, d1, d2, d3) -> (d0, d3)",
            "(d0, d1, d2, d3) -> (d0, d1, d2)",
        ],
        "nomk",
        {"m": (0, 2), "k": (0, 0), "n": (1, 0)},
    ),
    "attention_qkt": (
        [
            "(d0, d1, d2, d3) -> (d0, d1, d3)",
            "(d0, d1, d2, d3) -> (d0, d2, d3)",
            "(d0, d1, d2, d3) -> (d0, d1, d2)",
        ],
        "bmnk",
        {"m": (0, 1), "k": (0, 2), "n": (1, 1)},
    ),
    "attention_batch_matmul": (
        [
            "(d0, d1, d2, d3) -> (d0, d1, d3)",
            "(d0, d1, d2, d3) -> (d0, d3, d2)",
            "(d0, d1, d2, d3) -> (d0, d1, d2)",
        ],
        "bmnk",
        {"m": (0, 1), "k": (0, 2), "n": (1, 2)},
    ),
}

# (tile of M and N, tile of K, threads per M and N): 8x8 results per thread at 64.
TIERS = [(64, 32, 8), (16, 16, 4), (8, 8, 2)]


def _maps(maps: list[str]) -> str:
    return ",\n      ".join(f"affine_map<{m}>" for m in maps)


def _config(roles: str, tile: int, ktile: int, threads: int) -> str:
    sizes = [{"b": 1, "o": 1, "m": tile, "n": tile, "k": ktile}[r] for r in roles]
    return (
        "#iree_codegen.compilation_info<\n"
        f"    lowering_config = #iree_codegen.lowering_config<tile_sizes = [{sizes}]>,\n"
        "    translation_info = #iree_codegen.translation_info<"
        "pipeline = #iree_gpu.spirv_pipeline<MatmulPromoteVectorize>\n"
        f"      workgroup_size = [{threads}, {threads}, 1],"
        " {pipeline_depth = 1 : i64, store_stage = 1 : i64}>>"
    )


def _match_head(name: str, maps: list[str], checks: list[tuple[int, int, int]]) -> list[str]:
    lines = [
        f"transform.named_sequence @{name}(%op: !transform.any_op {{transform.readonly}})",
        "    -> (!transform.any_op, !transform.any_param) {",
        "  transform.iree.match.has_no_lowering_config %op : !transform.any_op",
        "  %b, %m, %n, %k = transform.iree.match.contraction %op,",
        "    lhs_type = f16, rhs_type = f16, output_type = f32,",
        f"    indexing_maps = [\n      {_maps(maps)}] : !transform.any_op -> !transform.param<i64>",
    ]
    operands = sorted({o for o, _, _ in checks})
    for o in operands:
        lines.append(
            f"  %in{o} = transform.get_operand %op[{o}] : (!transform.any_op) -> !transform.any_value"
        )
    for o, dim, size in checks:
        lines.append(
            f"  transform.iree.match.dim_is_multiple_of %in{o}[{dim}], {size} : !transform.any_value"
        )
    return lines


def render() -> str:
    out = [
        "// Generated by tools/make_vulkan_tuning_spec.py; edit that script, not this file.",
        "// vulkan-spirv: the contractions iree 3.13's cooperative-matrix codegen fails on go to",
        "// the SIMT matmul pipeline; every other op keeps the compiler's own choice.",
        "module @sdiree_vulkan_coopmatrix_fallback attributes {transform.with_named_sequence,",
        "    iree_codegen.tuning_spec_with_default_entrypoint} {",
        "",
        *APPLY_OP_CONFIG,
    ]
    pairs = []
    for cname, (maps, roles, where) in CLASSES.items():
        for tile, ktile, threads in TIERS:
            name = f"match_{cname}_{tile}"
            checks = [(*where["m"], tile), (*where["n"], tile), (*where["k"], ktile)]
            out += _match_head(name, maps, checks)
            out += yield_config(_config(roles, tile, ktile, threads))
            pairs.append((name, "apply_op_config"))
    out += entrypoint(pairs)
    return "\n".join(out)


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else SPEC
    path.write_text(render())
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
