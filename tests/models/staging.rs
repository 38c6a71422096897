//! A proptest model of the staging pipeline on the simulated device: random sizes around every
//! boundary, random ring depths, copy-thread counts and chunk sizes, and random faults at every
//! step. The reference is the host data itself: whatever comes back must equal it, and whatever
//! fails must leave the ring, the retirement queue and the pinned memory accounted for.

use cuferry::sim::{SimConfig, SimOp};
use cuferry::{
    CudaEngine, Error, download_tensor, error::DriverError, staging::StagingConfig, upload_tensor,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Case {
    chunk: usize,
    cutoff: usize,
    depth: usize,
    threads: usize,
    elems: usize,
    upload: bool,
    fault: Option<(SimOp, u64)>,
}

fn boundary_elems(chunk: usize, cutoff: usize, depth: usize) -> impl Strategy<Value = usize> {
    // Element counts (u32) around 16 B, the cutoff, one chunk, the ring and a few chunks.
    let points = vec![
        1,
        4,
        5,
        cutoff / 4,
        chunk / 4,
        chunk * depth / 4,
        chunk * 3 / 4,
        chunk * (depth + 2) / 4,
    ];
    (prop::sample::select(points), -2i64..=2).prop_map(|(p, d)| (p as i64 + d).max(1) as usize)
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![4096usize, 8192, 16384]),
        1usize..=4,
        1usize..=4,
        any::<bool>(),
    )
        .prop_flat_map(|(chunk, depth, threads, upload)| {
            let cutoff = chunk / 4;
            let fault = prop::option::weighted(
                0.7,
                (
                    prop::sample::select(vec![
                        SimOp::HostAlloc,
                        if upload {
                            SimOp::CopyHtoD
                        } else {
                            SimOp::CopyDtoH
                        },
                        SimOp::EventRecord,
                        SimOp::EventSynchronize,
                    ]),
                    1u64..=8,
                ),
            );
            (boundary_elems(chunk, cutoff, depth), fault).prop_map(move |(elems, fault)| Case {
                chunk,
                cutoff,
                depth,
                threads,
                elems,
                upload,
                fault,
            })
        })
}

fn run(case: &Case) -> Result<(), TestCaseError> {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sim = engine.sim().unwrap();
    let mut config = StagingConfig::default();
    config.chunk_bytes = case.chunk;
    config.cutoff_bytes = case.cutoff;
    config.ring_depth = case.depth;
    config.copy_threads = case.threads;
    engine.set_staging_config(config).unwrap();
    let data: Vec<u32> = (0..case.elems as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) | 1)
        .collect();
    let source = if case.upload {
        None
    } else {
        let t = upload_tensor(&mut engine, &data, &[case.elems]).unwrap();
        engine.set_staging_config(config).unwrap(); // an empty ring: acquisition allocates
        Some(t)
    };
    let injected = match case.fault {
        Some((op, n)) => {
            let error = if op == SimOp::EventSynchronize {
                DriverError::LAUNCH_FAILED
            } else {
                DriverError::OUT_OF_MEMORY
            };
            sim.fail_nth(op, n, error);
            Some(error)
        }
        None => None,
    };
    let result = match &source {
        None => upload_tensor(&mut engine, &data, &[case.elems])
            .and_then(|t| download_tensor(&mut engine, &t)),
        Some(t) => download_tensor(&mut engine, t),
    };
    let failed_wait = match result {
        Ok(back) => {
            prop_assert_eq!(back, data.clone());
            false
        }
        Err(e) => {
            let code = match &e {
                Error::Driver { source, .. } | Error::DeviceFault { source, .. } => *source,
                other => return Err(TestCaseError::fail(format!("unexpected error {other}"))),
            };
            prop_assert_eq!(Some(code), injected, "{}", e);
            code == DriverError::LAUNCH_FAILED
        }
    };
    sim.clear_faults();
    engine.synchronize().unwrap();
    let staging = engine.staging_stats();
    let retire = engine.retirement_stats();
    // A slot whose chunk failed is retained: a ring slot stays out of the ring, counted as
    // leased; the 16-byte slot of the smallest band (u32 data of at most 4 elements) is outside
    // the ring's accounting.
    let retained_scalar = usize::from(failed_wait && case.elems * 4 <= 16);
    prop_assert_eq!(retire.pending, 0);
    prop_assert_eq!(retire.retained, usize::from(failed_wait));
    prop_assert_eq!(staging.leased, retire.retained - retained_scalar);
    prop_assert!(staging.slots <= case.depth + retire.retained);
    let scalar = usize::from(staging.scalar_slot);
    prop_assert_eq!(
        sim.pinned_live().0,
        staging.slots + scalar + retained_scalar
    );
    prop_assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    // The engine keeps working after any failure.
    let t = upload_tensor(&mut engine, &data, &[case.elems]).unwrap();
    prop_assert_eq!(download_tensor(&mut engine, &t).unwrap(), data);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_pipeline_matches_the_model_under_random_faults(case in case()) {
        run(&case)?;
    }
}
