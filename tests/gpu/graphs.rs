//! Prepared programs on device 0: the bodies in `tests/bodies/graphs.rs`, which the simulator
//! binary runs too.

crate::bodies!(gpu; graphs::{
    a_second_program_with_the_same_group_compiles_nothing,
    runs_rebind_only_what_moved_and_reuse_dropped_outputs,
    bad_inputs_and_other_engines_are_refused_and_nothing_runs,
    products_of_inputs_run_between_graph_launches,
});
