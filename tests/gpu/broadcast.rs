//! Broadcasting elementwise operations, transposed products and `linear` on the GPU, against
//! host references: the key cases of `tests/sim/broadcast.rs`, written once in
//! `tests/bodies/broadcast.rs`, which the simulator binary runs too.

crate::bodies!(gpu; broadcast::{
    a_bias_a_column_and_a_scalar_broadcast_on_either_side,
    matmul_t_in_each_combination_and_linear_with_a_bias,
    prepared_programs_broadcast_as_the_eager_ops_and_linear_takes_a_bias,
});
