//! The fault sweep: a mixed workload (every route, kernels, library calls, detached values,
//! teardown) with a driver failure injected at every driver call in turn, and at two calls at
//! once for a sample of pairs. After each run: every failure is a typed error that was reported,
//! no wrong data was returned, nothing was freed while a copy still named it, the engine either
//! works again or refuses clearly, and what is still pinned or allocated after teardown is what
//! the engine says it retained.

use crate::support::distinct_salted as distinct;
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, Error, PinnedHostBuffer, download_pending, download_tensor, download_tensor_into,
    error::DriverError, staging::StagingConfig, upload_pending, upload_tensor,
};

/// Every operation the workload reaches, with the failure a real driver could report for it.
/// (An out-of-memory allocation is retried once after releasing what is proven; a refused one
/// is not, so the sweep uses the refusal to see every allocation failure reported.)
const OPS: [(SimOp, DriverError); 16] = [
    (SimOp::Alloc, DriverError::INVALID_VALUE),
    (SimOp::Free, DriverError::INVALID_VALUE),
    (SimOp::CopyHtoD, DriverError::INVALID_VALUE),
    (SimOp::CopyDtoH, DriverError::INVALID_VALUE),
    (SimOp::CopyDtoD, DriverError::INVALID_VALUE),
    (SimOp::EventCreate, DriverError::OUT_OF_MEMORY),
    (SimOp::EventRecord, DriverError::UNKNOWN),
    (SimOp::EventQuery, DriverError::LAUNCH_FAILED),
    (SimOp::EventSynchronize, DriverError::LAUNCH_FAILED),
    (SimOp::EventDestroy, DriverError::INVALID_VALUE),
    (SimOp::HostAlloc, DriverError::OUT_OF_MEMORY),
    (SimOp::HostFree, DriverError::INVALID_VALUE),
    (SimOp::StreamSynchronize, DriverError::LAUNCH_FAILED),
    (SimOp::Launch, DriverError::LAUNCH_FAILED),
    (SimOp::LibraryOpen, DriverError::UNKNOWN),
    (SimOp::Gemm, DriverError::LAUNCH_FAILED),
];

/// Checks a result: data that comes back is right; a failure is one of the crate's typed errors.
fn check<T>(result: Result<T, Error>, ok: impl FnOnce(T)) -> Result<(), Error> {
    match result {
        Ok(value) => {
            ok(value);
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// The workload. Returns the first error it met (it stops there, dropping what it holds, as a
/// caller's `?` would).
fn workload(engine: &mut CudaEngine) -> Result<(), Error> {
    let mut config = StagingConfig::default();
    config.chunk_bytes = 4096;
    config.cutoff_bytes = 1024;
    config.ring_depth = 2;
    engine.set_staging_config(config)?;

    // Blocking routes, every band: scalar, one staged copy, the pipeline.
    let small = distinct(3, 1);
    let mid = distinct(200, 2);
    let big = distinct(3000, 3);
    let t_small = upload_tensor(engine, &small, &[3])?;
    let t_mid = upload_tensor(engine, &mid, &[200])?;
    let t_big = upload_tensor(engine, &big, &[3000])?;
    check(download_tensor(engine, &t_small), |v| assert_eq!(v, small))?;
    check(download_tensor(engine, &t_big), |v| assert_eq!(v, big))?;
    let out = download_tensor_into(engine, &t_mid, Vec::new())?;
    assert_eq!(out, mid);

    // Kernels on the stream, read back.
    let sum = engine.add(&t_mid, &t_mid)?;
    let expected: Vec<u32> = mid.iter().map(|x| x.wrapping_add(*x)).collect();
    check(download_tensor(engine, &sum), |v| assert_eq!(v, expected))?;
    let copy = engine.copy_tensor(&t_big)?;

    // A library call on the stream, read back: [[1, 2], [3, 4]] squared.
    let a = upload_tensor(engine, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    let squared = engine.matmul(&a, &a)?;
    check(download_tensor(engine, &squared), |v| {
        assert_eq!(v, [7.0, 10.0, 15.0, 22.0])
    })?;

    // Pending routes: submit, wait, resubmit, detach, download.
    let buffer = PinnedHostBuffer::from_slice(engine, &big)?;
    let dest = engine.alloc_tensor::<u32>(&[3000])?;
    let returned = upload_pending(engine, buffer, dest)
        .map_err(|e| e.into_error())?
        .wait()?;
    let again = returned.resubmit(engine).map_err(|e| e.into_error())?;
    drop(again); // detached while in flight
    let buffer = PinnedHostBuffer::<u32>::new(engine, 3000)?;
    let back = download_pending(engine, copy, buffer)
        .map_err(|e| e.into_error())?
        .wait()?;
    assert_eq!(back.buffer().as_slice(), &big[..]);
    drop(back);

    // A hand-built staging chunk, retired while in flight.
    let mut lease = engine.staging_lease()?;
    lease.as_mut_bytes()[..8].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    let mut bytes = engine.alloc_tensor::<u8>(&[8])?;
    match lease.begin_upload(engine, &mut bytes, 0, 8) {
        Ok(unproven) => unproven.retire_with(bytes),
        Err(
            cuferry::SubmitError::Rejected {
                input: lease,
                error,
            }
            | cuferry::SubmitError::Failed {
                input: lease,
                error,
            },
        ) => {
            lease.release();
            return Err(error);
        }
        Err(cuferry::SubmitError::Retained { error }) => {
            drop(bytes); // its free is ordered after the copy on the device
            return Err(error);
        }
    }
    #[cfg(feature = "safetensors")]
    sliced_load(engine)?;
    engine.flush()?;
    engine.synchronize()
}

/// A checkpoint load that slices and converts: columns 10..45 of a [40, 50] u32 tensor (one
/// read per row, two slots, three readers), loaded as f32 (a cast queued after the copies).
#[cfg(feature = "safetensors")]
fn sliced_load(engine: &mut CudaEngine) -> Result<(), Error> {
    use cuferry::checkpoint::{self, LoadOptions, Slice};
    let grid = distinct(2000, 4);
    let bytes: Vec<u8> = grid.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![40, 50], &bytes)
        .unwrap();
    let file = safetensors::serialize([("grid", view)], None).unwrap();
    let options = LoadOptions::new()
        .readers(3)
        .slices(|_, _| Ok(Slice::Columns(10..45)))
        .convert(|_, _| cuferry::DType::F32);
    let path = std::path::Path::new("grid.safetensors");
    let mut loaded = checkpoint::load_from(engine, path, &&file[..], file.len() as u64, options)?;
    let t = loaded.take::<f32>("grid")?;
    let want: Vec<f32> = (0..40)
        .flat_map(|r| (10..45).map(move |c| r * 50 + c))
        .map(|i| grid[i] as f32)
        .collect();
    check(download_tensor(engine, &t), |v| assert_eq!(v, want))?;
    // Five small tensors, packed into one allocation by a load through 64 KiB slots: one of
    // them kept, the others dropped at once.
    let mut config = engine.staging_config();
    config.chunk_bytes = 64 << 10;
    engine.set_staging_config(config)?;
    let norms: Vec<Vec<u32>> = (0..5).map(|i| distinct(50 + i * 7, 5 + i as u32)).collect();
    let bytes: Vec<Vec<u8>> = norms
        .iter()
        .map(|n| n.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = bytes.iter().enumerate().map(|(i, b)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![b.len() / 4], b);
        (format!("norm{i}"), view.unwrap())
    });
    let file = safetensors::serialize(views, None).unwrap();
    let path = std::path::Path::new("norms.safetensors");
    let options = LoadOptions::new().readers(2);
    let mut loaded = checkpoint::load_from(engine, path, &&file[..], file.len() as u64, options)?;
    let kept = loaded.take::<u32>("norm3")?;
    drop(loaded);
    check(download_tensor(engine, &kept), |v| assert_eq!(v, norms[3]))
}

/// One run with faults armed by `arm`; returns a description of what went wrong, if anything.
/// `refused_frees` is how many of the armed faults refuse a free: the driver keeps that memory,
/// and the engine reports the refusal.
fn run(refused_frees: usize, arm: impl FnOnce(&SimDevice)) -> Result<usize, String> {
    let sim = SimDevice::new(SimConfig::default());
    let mut engine = CudaEngine::simulated_on(&sim);
    engine
        .set_pinned_pool_budget(0)
        .map_err(|e| e.to_string())?;
    arm(&sim);
    let outcome = workload(&mut engine);
    // Whatever the workload met, the boundaries report the rest, once; then nothing is left.
    let flushed = engine.flush();
    let synced = engine.synchronize();
    sim.clear_faults();
    let failures = usize::from(outcome.is_err())
        + usize::from(flushed.is_err())
        + usize::from(synced.is_err());
    if let Err(e) = engine.synchronize() {
        return Err(format!("a failure was reported twice: {e}"));
    }
    // The engine works again (or refuses clearly).
    let data = distinct(1500, 9);
    match upload_tensor(&mut engine, &data, &[1500]).and_then(|t| download_tensor(&mut engine, &t))
    {
        Ok(back) if back == data => {}
        Ok(_) => return Err("wrong data after the fault".into()),
        Err(e) => return Err(format!("the engine did not recover: {e}")),
    }
    let retained = engine.retirement_stats().retained;
    drop(engine);
    if !sim.violations().is_empty() {
        return Err(format!("violations: {:?}", sim.violations()));
    }
    let (pinned, _) = sim.pinned_live();
    let (device, _) = sim.device_live();
    if pinned > retained + refused_frees || device > 2 * retained + refused_frees {
        return Err(format!(
            "after teardown {pinned} pinned and {device} device allocations live, {retained} retained"
        ));
    }
    Ok(failures)
}

/// How often each operation runs in one clean pass: up to the end of the workload, and in all
/// (teardown included).
fn clean_calls() -> (Vec<u64>, Vec<u64>) {
    let sim = SimDevice::new(SimConfig::default());
    let mut engine = CudaEngine::simulated_on(&sim);
    engine.set_pinned_pool_budget(0).unwrap();
    workload(&mut engine).unwrap();
    let before_teardown = OPS.iter().map(|&(op, _)| sim.calls(op)).collect();
    drop(engine);
    (
        before_teardown,
        OPS.iter().map(|&(op, _)| sim.calls(op)).collect(),
    )
}

#[test]
fn a_fault_at_every_driver_call_is_reported_and_loses_nothing() {
    let (workload_counts, counts) = clean_calls();
    let mut runs = 0;
    for ((&(op, error), &count), &in_workload) in OPS.iter().zip(&counts).zip(&workload_counts) {
        for n in 1..=count {
            let refused = usize::from(matches!(op, SimOp::Free | SimOp::HostFree));
            match run(refused, |sim| sim.fail_nth(op, n, error)) {
                // A fault during the workload is reported; one at teardown cannot be (a drop
                // never reports). A failed background query is retried, and a failed pinned
                // allocation is retried after releasing what is proven: neither is a failure
                // when the retry succeeds.
                Ok(0)
                    if n <= in_workload && !matches!(op, SimOp::EventQuery | SimOp::HostAlloc) =>
                {
                    panic!("a fault at {op:?} call {n} was never reported")
                }
                Ok(_) => {}
                Err(what) => panic!("a fault at {op:?} call {n}: {what}"),
            }
            runs += 1;
        }
    }
    // Event faults: the n-th recorded event reports a failure when the device reaches it.
    let events = counts[OPS.iter().position(|o| o.0 == SimOp::EventRecord).unwrap()];
    for n in 1..=events {
        match run(0, |sim| sim.fail_event(n, DriverError::LAUNCH_FAILED)) {
            Ok(failures) => assert!(failures > 0, "event fault {n} was never reported"),
            Err(what) => panic!("an event fault at record {n}: {what}"),
        }
        runs += 1;
    }
    // The workload reaches every listed operation, so every kind of fault was injected.
    for (&(op, _), &count) in OPS.iter().zip(&counts) {
        assert!(count > 0, "the workload never calls {op:?}");
    }
    assert!(runs > 80, "only {runs} runs");
}

#[test]
fn two_faults_at_once_are_reported_and_lose_nothing() {
    let (_, counts) = clean_calls();
    let points: Vec<(SimOp, DriverError, u64)> = OPS
        .iter()
        .zip(&counts)
        .flat_map(|(&(op, e), &count)| (1..=count).map(move |n| (op, e, n)))
        .collect();
    // A fixed sample of pairs (xorshift), the same in every run.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state as usize
    };
    for _ in 0..300 {
        let (op1, e1, n1) = points[next() % points.len()];
        let (op2, e2, n2) = points[next() % points.len()];
        let refused = [op1, op2]
            .iter()
            .filter(|op| matches!(op, SimOp::Free | SimOp::HostFree))
            .count();
        if let Err(what) = run(refused, |sim| {
            sim.fail_nth(op1, n1, e1);
            sim.fail_nth(op2, n2, e2);
        }) {
            panic!("faults at {op1:?} call {n1} and {op2:?} call {n2}: {what}");
        }
    }
}
