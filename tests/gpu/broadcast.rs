//! Broadcasting elementwise operations, transposed products and `linear` on the GPU, against
//! host references: the bodies of `tests/bodies/broadcast.rs`, which the simulator binary runs
//! too.

crate::bodies!(gpu; broadcast::{
    a_bias_a_column_and_a_scalar_broadcast_on_either_side,
    matmul_t_in_each_combination_and_linear_with_a_bias,
    prepared_programs_broadcast_as_the_eager_ops_and_linear_takes_a_bias,
    binary_ops_broadcast_a_trailing_shape_for_every_element_family,
    half_types_broadcast_a_bias_like_their_f32_result,
    shapes_that_do_not_broadcast_get_a_typed_error_naming_both_and_leak_nothing,
    cast_infers_its_source_type,
    matmul_t_takes_each_of_the_four_transpose_combinations,
    linear_is_x_times_w_transposed_plus_bias_in_pytorchs_layout,
    prepared_matmul_t_and_linear_replay_the_eager_values,
    prepared_programs_broadcast_as_the_eager_ops_do_element_for_element,
    a_fused_chain_broadcasts_computed_operands_and_one_value_two_ways,
    a_traced_broadcast_that_does_not_fit_is_refused_with_the_eager_error,
    a_traced_linear_with_a_bias_equals_the_eager_linear,
});
