//! Awaiting pending transfers on device 0: woken by the driver's stream callbacks, on tokio's
//! current-thread and multi-thread runtimes. The bodies are in `tests/bodies/awaiting.rs`, which
//! the simulator binary runs too.

crate::bodies!(gpu; awaiting::{
    uploads_and_downloads_awaited_on_a_current_thread_runtime,
    uploads_and_downloads_awaited_on_a_multi_thread_runtime,
    many_transfers_awaited_at_once_all_complete,
    transfers_over_registered_buffers_are_awaited_and_hand_their_vec_back,
});
