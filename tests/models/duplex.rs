//! The engine's one order over its three streams, checked on the simulated device against a
//! reference that runs everything in program order on one stream (the model is
//! `tests/support/duplex.rs`).
//!
//! Random interleavings of pending and blocking uploads and downloads, kernels (on resident
//! tensors and on in-flight destinations and sources), device copies, fills, raw scopes, waits,
//! detached transfers, drops, flushes and synchronizes run on a simulated engine whose device picks
//! the next stream to run at random (`Schedule::Interleaved`), so uploads, downloads and kernels
//! complete in every order the waits allow. Checked after every step: the device saw no two
//! operations on the same memory run out of the order they were queued in (the simulator's race
//! check), and every value the host reads back is bit-identical to the reference. A second
//! property injects faults into the cross-stream waits and the ordering events' records: every
//! failure is a typed error, nothing runs out of order, nothing leaks.

use crate::support::duplex::{Run, op};
use cuferry::error::DriverError;
use cuferry::sim::SimOp;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(debug_assertions) { 192 } else { 512 },
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    })]

    /// Every interleaving the schedule picks reads what the reference computes, and nothing runs
    /// out of order.
    #[test]
    fn three_streams_keep_program_order_through_every_value(
        len in prop_oneof![Just(1usize), Just(17), Just(1025)],
        seed in any::<u64>(),
        ops in proptest::collection::vec(op(), 1..48),
    ) {
        let mut run = Run::simulated(len, seed, false);
        for op in &ops {
            run.apply(op);
        }
        run.finish();
    }

    /// A refused cross-stream wait or ordering record is a typed error where it can be reported,
    /// and never lets work run out of order or memory leak.
    #[test]
    fn refused_waits_and_ordering_records_lose_nothing(
        seed in any::<u64>(),
        fault_op in prop_oneof![Just(SimOp::StreamWait), Just(SimOp::OrderRecord)],
        nth in 1u64..6,
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let mut run = Run::simulated(17, seed, true);
        run.sim().expect("a simulated engine").fail_nth(fault_op, nth, DriverError::LAUNCH_FAILED);
        for op in &ops {
            run.apply(op);
        }
        run.finish();
    }
}
