//! Peer copies between engines: two engines on device 0, and device 0 and 1 where the machine
//! has a second GPU. The bodies are in `tests/bodies/peer.rs`, which the simulator binary runs
//! too.

crate::bodies::peer::tests!(gpu);
