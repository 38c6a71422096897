//! Peer copies between engines: two engines on device 0, and device 0 and 1 where the machine
//! has a second GPU. The bodies are in `tests/bodies/peer.rs`, which the simulator binary runs
//! too.

crate::bodies!(gpu; peer::{
    every_element_type_crosses_between_engines,
    peer_copies_in_each_direction_at_once,
    every_element_type_crosses_pending_between_engines,
    a_pending_copy_follows_the_sources_queued_kernels_and_precedes_the_destinations,
    resubmission_copies_again_with_nothing_allocated,
    awaited_on_any_executor,
});
