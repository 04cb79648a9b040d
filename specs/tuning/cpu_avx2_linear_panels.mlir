// cpu fp32 on CPUs without AVX-512: the UNet's linears, traced over their weights as panels of 16
// output features (export choice `linear: "panels"`, compile/exporters/linear_panels.py), get a
// 6x16 register tile.
//
// A codegen tuning spec. A linear so traced reaches codegen as one f32 `linalg.generic`
// contraction over (m, j, n, k): x[m, k] * panels[j, k, n] summed over k into out[m, j, n],
// n = 16 wide, with its bias and whatever follows fused behind it. It is not data-tiled (it is
// no matmul when iree decides data tiling), and iree's default config for it runs it at a third
// of the ukernels' speed; this one does better than the data-tiled 8x8 ukernel: per k, six
// broadcasts of x, two 8-wide loads of one panel row, twelve FMAs (iree 3.13's AVX2 f32 tile:
// eight broadcasts, one load, eight FMAs). Workgroups of 48 rows by 4 panels (64 features),
// K one at a time (the FMAs add the K products in order), loops peeled (M = 2^k rows against
// 6-row vectors would otherwise be masked). Matched by the contraction's maps and element
// types, never by size: nothing else in the UNet has a 3-D right operand read (j, k, n).
// Why: compile/NOTES.md, "The UNet's linears as weight panels on AVX2".
module @sdiree_cpu_avx2_linear_panels attributes {transform.with_named_sequence,
    iree_codegen.tuning_spec_with_default_entrypoint} {

transform.named_sequence @apply_root(%root: !transform.any_op {transform.readonly},
    %config: !transform.any_param {transform.readonly}) {
  transform.annotate %root "compilation_info" = %config : !transform.any_op, !transform.any_param
  transform.annotate %root "__tuning_spec_applied__" : !transform.any_op
  transform.yield
}

transform.named_sequence @match_panel_contraction(%op: !transform.any_op {transform.readonly})
    -> (!transform.any_op, !transform.any_param) {
  transform.match.operation_name %op ["linalg.generic"] : !transform.any_op
  %batch, %m, %n, %k = transform.iree.match.contraction %op,
      lhs_type = f32, rhs_type = f32, output_type = f32,
      indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d3)>,
                       affine_map<(d0, d1, d2, d3) -> (d1, d3, d2)>,
                       affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>]
    : !transform.any_op -> !transform.param<i64>
  %config = transform.param.constant #iree_codegen.compilation_info<
      lowering_config = #iree_cpu.lowering_config<distribution = [48, 4, 16, 0],
        vector_common_parallel = [6, 1, 16, 0], vector_reduction = [0, 0, 0, 1]>,
      translation_info = #iree_codegen.translation_info<
        pipeline = #iree_cpu.pipeline<DoubleTilingExpert>, {enable_loop_peeling}>>
    -> !transform.any_param
  transform.yield %op, %config : !transform.any_op, !transform.any_param
}

transform.named_sequence @__kernel_config(%variant_op: !transform.any_op {transform.consumed})
    -> !transform.any_op attributes {iree_codegen.tuning_spec_entrypoint} {
  %res = transform.foreach_match in %variant_op
      @match_panel_contraction -> @apply_root
    : (!transform.any_op) -> !transform.any_op
  transform.yield %res : !transform.any_op
}
}
