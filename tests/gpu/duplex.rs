//! The engine's one order over its three streams on the GPU: the model of
//! `tests/support/duplex.rs` (pending and blocking transfers, kernels on resident and in-flight
//! tensors, device copies, raw scopes, waits and drops, in random order) on a real engine, where
//! the copy engines and the SMs really run at once, read back against the program-order
//! reference. Fewer cases than on the simulated device; 4 MiB slots, so copies overlap kernels.

use crate::reference::duplex::{Run, op};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        max_shrink_iters: 200,
        ..ProptestConfig::default()
    })]

    #[test]
    #[ignore = "needs a CUDA device"]
    fn three_streams_keep_program_order_on_the_gpu(
        len in prop_oneof![Just(17usize), Just(1usize << 20)],
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let mut run = Run::on(crate::engine(), len, false);
        for op in &ops {
            run.apply(op);
        }
        run.finish();
    }
}
