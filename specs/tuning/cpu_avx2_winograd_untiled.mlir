// cpu fp32 on CPUs without AVX-512 (targets.json: dtype_options.fp32.preprocessing_specs_if_cpu_lacks):
// the VAE's split Winograd products leave data tiling for a 6x16 register tile.
//
// A preprocessing transform spec (--iree-preprocessing-transform-spec-filename), applied before
// global optimization. On AVX2, iree 3.13 data-tiles every f32 matmul into an 8x8x1 tile whose
// ukernel does one load and eight broadcasts per eight FMAs (~55 % of the FMA peak of a Zen 3
// core); a 6x16 register tile (two loads and six broadcasts per twelve FMAs) reaches ~85 %.
// No flag changes the data-tiling tile, so this spec takes the matmuls where the untiled 6x16
// codegen wins out of data tiling and gives them that tile:
// - @match_winograd_product: a 2-D f32 `linalg.matmul` in normal form whose right operand is one
//   tile element of a Winograd weight (`tensor.collapse_shape` of a `tensor.extract_slice`) and
//   whose N is a multiple of 64: the split Winograd convs' products (export choice
//   winograd_split_min_side). It gets a compilation_info: workgroups of 48x64, 6x16 vectors,
//   K one at a time (the FMAs add the K products in order, as the ukernel does: same results),
//   loops peeled (without peeling, M = 2^k against 6-row vectors gets masked and runs ~4x slower).
// - @match_f32_contraction: every other f32 contraction gets `iree.opt.data_tiling`. Once any op
//   carries that mark, iree data-tiles only the marked ones (AnnotateDataTilingHints), so
//   attention, 1x1 convs, im2col convs and batched Winograd products keep the ukernels.
// Matched by structure, element type and divisibility, never by size. Why these ops and no
// others (large K, transposed weights and the batched form lose untiled): compile/NOTES.md,
// "The VAE's Winograd products untiled on AVX2".
module @sdiree_cpu_avx2_winograd_untiled attributes {transform.with_named_sequence} {

transform.named_sequence @data_tile(%op: !transform.any_op {transform.readonly}) {
  %unit = transform.param.constant unit -> !transform.any_param
  transform.annotate %op "iree.opt.data_tiling" = %unit : !transform.any_op, !transform.any_param
  transform.yield
}

transform.named_sequence @tile_6x16(%op: !transform.any_op {transform.readonly}) {
  %config = transform.param.constant #iree_codegen.compilation_info<
      lowering_config = #iree_cpu.lowering_config<distribution = [48, 64, 0],
        vector_common_parallel = [6, 16, 0], vector_reduction = [0, 0, 1]>,
      translation_info = #iree_codegen.translation_info<
        pipeline = #iree_cpu.pipeline<DoubleTilingExpert>, {enable_loop_peeling}>>
    -> !transform.any_param
  transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param
  transform.yield
}

transform.named_sequence @match_winograd_product(%op: !transform.any_op {transform.readonly})
    -> !transform.any_op {
  transform.match.operation_name %op ["linalg.matmul"] : !transform.any_op
  %batch, %m, %n, %k = transform.iree.match.contraction %op,
      lhs_type = f32, rhs_type = f32, output_type = f32,
      indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>,
                       affine_map<(d0, d1, d2) -> (d2, d1)>,
                       affine_map<(d0, d1, d2) -> (d0, d1)>]
    : !transform.any_op -> !transform.param<i64>
  %rhs = transform.get_operand %op[1] : (!transform.any_op) -> !transform.any_value
  %collapse = transform.get_defining_op %rhs : (!transform.any_value) -> !transform.any_op
  transform.match.operation_name %collapse ["tensor.collapse_shape"] : !transform.any_op
  %whole = transform.get_operand %collapse[0] : (!transform.any_op) -> !transform.any_value
  %slice = transform.get_defining_op %whole : (!transform.any_value) -> !transform.any_op
  transform.match.operation_name %slice ["tensor.extract_slice"] : !transform.any_op
  transform.iree.match.dim_is_multiple_of %rhs[1], 64 : !transform.any_value
  transform.yield %op : !transform.any_op
}

transform.named_sequence @match_f32_contraction(%op: !transform.any_op {transform.readonly})
    -> !transform.any_op {
  %batch, %m, %n, %k = transform.iree.match.contraction %op,
      lhs_type = f32, rhs_type = f32, output_type = f32
    : !transform.any_op -> !transform.param<i64>
  transform.yield %op : !transform.any_op
}

transform.named_sequence @__transform_main(%module: !transform.any_op {transform.consumed}) {
  transform.foreach_match in %module
      @match_winograd_product -> @tile_6x16,
      @match_f32_contraction -> @data_tile
    : (!transform.any_op) -> !transform.any_op
  transform.yield
}
}
