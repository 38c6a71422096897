//! Registered buffers on device 0: `Vec`s page-locked in place, round-tripped through the
//! pending routes, and given back as the same allocation. The bodies are in
//! `tests/bodies/registered.rs`, which the simulator binary runs too.

crate::bodies!(gpu; registered::{
    register_and_into_vec_give_back_the_same_vec,
    round_trips_for_every_element_type_at_every_size,
    resubmission_registers_nothing_more,
    an_empty_vec_is_refused_and_comes_back,
    rejected_submissions_give_the_buffer_back,
    registered_vecs_round_trip_and_come_back_as_the_same_allocation,
    a_dropped_in_flight_transfer_releases_its_registered_buffer_after_the_copy,
    two_small_vecs_registered_at_once,
});
