"""Text shared by the GPU tuning-spec generators (tools/make_vulkan_tuning_spec.py,
tools/make_vulkan_simt_spec.py, tools/make_rocm_tuning_spec.py, tools/cuda_conv_sweep.py): the
action that applies a matcher's configuration and marks the op (the marker is what tests find in
iree-compile's configuration dump), the heads of matchers of f16 contractions and channels-last
f16 convolutions, and the entry point that tries the matchers in order, the first that matches
an op winning."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

APPLY_OP_CONFIG = [
    "transform.named_sequence @apply_op_config(%op: !transform.any_op {transform.readonly},",
    "    %config: !transform.any_param {transform.readonly}) {",
    '  transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param',
    '  transform.annotate %op "__tuning_spec_applied__" : !transform.any_op',
    "  transform.yield",
    "}",
    "",
]


# The action of a matcher that keeps the compiler's own choice, and that matcher's last lines.
KEEP_DEFAULT = [
    "transform.named_sequence @keep_default(%op: !transform.any_op {transform.readonly},",
    "    %unused: !transform.any_param {transform.readonly}) {",
    "  transform.yield",
    "}",
    "",
]
YIELD_DEFAULT = [
    "  %none = transform.param.constant 0 : i64 -> !transform.any_param",
    "  transform.yield %op, %none : !transform.any_op, !transform.any_param",
    "}",
    "",
]

# (layout, stride): indexing maps of a channels-last conv (NHWC input, FHWC filter) and the
# dims of its output (oh, ow, oc). "batched": [n, oh, ow, c] (the UNet's guided call);
# "single": batch 1 folded away by iree (the UNet's unguided call, the VAE).
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


def conv_head(name: str, maps: list[str]) -> list[str]:
    """A matcher's first lines: an f16 x f16 -> f32 convolution of these indexing maps with no
    configuration yet, its output operand as `%out`."""
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


def _maps(maps: list[str]) -> str:
    return ",\n      ".join(f"affine_map<{m}>" for m in maps)


def contraction_head(name: str, maps: list[str], checks: list[tuple[int, int, int]]) -> list[str]:
    """A matcher's first lines: an f16 x f16 -> f32 contraction of these indexing maps with no
    configuration yet, each (operand, dim, size) of `checks` a multiple of size."""
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


def yield_config(config: str) -> list[str]:
    """A matcher's last lines: the configuration it gives the matched op, and its end."""
    return [
        f"  %config = transform.param.constant {config}",
        "    -> !transform.any_param",
        "  transform.yield %op, %config : !transform.any_op, !transform.any_param",
        "}",
        "",
    ]


def entrypoint(pairs: list[tuple[str, str]]) -> list[str]:
    """The `__kernel_config` entry point over (matcher, action) pairs, and the module's end."""
    return [
        "transform.named_sequence @__kernel_config(%variant_op: !transform.any_op {transform.consumed})",
        "    -> !transform.any_op attributes {iree_codegen.tuning_spec_entrypoint} {",
        "  %res = transform.foreach_match in %variant_op",
        ",\n".join(f"    @{m} -> @{a}" for m, a in pairs),
        "    : (!transform.any_op) -> !transform.any_op",
        "  transform.yield %res : !transform.any_op",
        "}",
        "",
        "}",
        "",
    ]


def write_spec(argv: list[str], default: Path, render: Callable[[], str]) -> None:
    """A generator's command line: write render() to argv's one path, else to default."""
    path = Path(argv[0]) if argv else default
    path.write_text(render())
    print(f"wrote {path}")
