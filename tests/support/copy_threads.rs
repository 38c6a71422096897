//! Every simulated-device test binary of the staged routes runs with four copy threads, whatever
//! the machine: the process's copy pool is sized once, from the machine unless told otherwise
//! (one thread on a 2-core machine, where the paths that hand host copies to a second thread
//! would never run). The size is set before `main`, so no test can build the pool first.

/// The copy threads these binaries run with.
pub(crate) const COPY_THREADS: usize = 4;

#[ctor::ctor(unsafe)]
fn size_the_copy_pool() {
    // Before `main`: nothing else runs yet, and the pool is not built.
    cuferry::staging::set_copy_threads(COPY_THREADS)
        .expect("the copy pool is sized before first use");
}

#[test]
fn the_staged_routes_run_with_two_or_more_copy_threads() {
    assert_eq!(cuferry::staging::copy_threads(), COPY_THREADS);
    assert!(cuferry::staging::copy_threads() >= 2);
    let engine = cuferry::CudaEngine::simulated(cuferry::sim::SimConfig::default());
    assert_eq!(engine.staging_config().copy_threads, COPY_THREADS);
}
