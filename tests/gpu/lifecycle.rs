//! The lifecycles behind every route, on device 0: the bodies in `tests/bodies/lifecycle.rs`,
//! which the simulator binary runs too.

crate::bodies!(gpu; lifecycle::{
    held_and_forgotten_leases_never_starve_the_blocking_routes,
    errors_name_the_values_and_the_shape_check_is_order_independent,
});
