// A tuning spec that matches nothing: a valid entry point for tests and a template for real specs.
module @sdiree_noop attributes {transform.with_named_sequence} {
  transform.named_sequence @__kernel_config(%root: !transform.any_op {transform.readonly}) -> !transform.any_op
      attributes {iree_codegen.tuning_spec_entrypoint} {
    transform.yield %root : !transform.any_op
  }
}
