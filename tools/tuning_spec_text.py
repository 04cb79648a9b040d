"""Text shared by the GPU tuning-spec generators (tools/make_vulkan_tuning_spec.py,
tools/make_rocm_tuning_spec.py): the action that applies a matcher's configuration and marks
the op (the marker is what tests find in iree-compile's configuration dump), and the entry
point that tries the matchers in order, the first that matches an op winning."""

from __future__ import annotations

APPLY_OP_CONFIG = [
    "transform.named_sequence @apply_op_config(%op: !transform.any_op {transform.readonly},",
    "    %config: !transform.any_param {transform.readonly}) {",
    '  transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param',
    '  transform.annotate %op "__tuning_spec_applied__" : !transform.any_op',
    "  transform.yield",
    "}",
    "",
]


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
