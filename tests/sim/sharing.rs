//! Device tensors shared between processes, on one simulated machine whose engines are
//! processes of their own (each simulated driver is one), run as threads and joined by the real
//! Unix socket: read-only shares and exclusive hand-offs ordered across processes with no host
//! wait, every order of releases and of the exporter's drop, an importer killed with imports in
//! use, one that lives on holding what it leaked, and a fault at every call of both sides. The
//! device records a violation for any free under a mapping, any use after an unmapping and any
//! unordered access, so each test ends by asking it.

use cuferry::error::{DriverError, ShareError};
use cuferry::share::{ShareLink, ShareListener};
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{CudaEngine, DeviceTensor, Error, SubmitError, download_tensor};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(20);
/// The deadline of each wait in the fault sweep, where a faulted step may leave the other side
/// waiting for a message that never comes.
const FAULT_DEADLINE: Duration = Duration::from_millis(500);

/// A socket path of the test's own.
fn socket(name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "cuferry-sharing-{}-{name}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// An importer process: a thread with an engine of its own on `sim`, connected to `path`, that
/// runs `body` and reports what it saw on a channel.
fn importer<R: Send + 'static>(
    sim: &SimDevice,
    path: &Path,
    body: impl FnOnce(CudaEngine, ShareLink, &Receiver<()>) -> R + Send + 'static,
) -> (JoinHandle<R>, Sender<()>) {
    let (sim, path) = (sim.clone(), path.to_path_buf());
    let (go, wait) = channel();
    let thread = std::thread::spawn(move || {
        let mut engine = CudaEngine::simulated_on(&sim);
        let mut link = ShareLink::connect(&mut engine, &path).unwrap();
        link.set_timeout(Some(DEADLINE));
        body(engine, link, &wait)
    });
    (thread, go)
}

fn no_violations(sim: &SimDevice) {
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// Waits until every device allocation but `baseline`'s is freed.
fn freed_down_to(sim: &SimDevice, engine: &mut CudaEngine, baseline: usize) {
    let start = std::time::Instant::now();
    loop {
        engine.synchronize().unwrap();
        if sim.device_live().0 <= baseline {
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{:?} still live",
            sim.device_live()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_read_only_share_reaches_every_importer_after_the_exporters_writes() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let baseline = sim.device_live().0;
    let path = socket("read");
    let listener = ShareListener::bind(&path).unwrap();
    let mut threads = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..2 {
        let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
            let weights = link.import_read::<f32>(&mut engine).unwrap();
            // A kernel of this process reads the exporter's memory.
            let doubled = engine.scale(&weights, 2.0).unwrap();
            let seen = download_tensor(&mut engine, &doubled).unwrap();
            go.recv().unwrap();
            drop(weights);
            seen
        });
        threads.push((thread, go));
        handles.push(listener.accept(&mut exporter).unwrap());
    }
    // The last write is a kernel still queued when the offers leave: the importers' streams
    // wait for it on the device.
    let ones = exporter.full(&[1000], 1.0f32).unwrap();
    let tensor = exporter.scale(&ones, 3.0).unwrap();
    let shared = exporter.export_tensor(tensor).unwrap();
    for handle in &handles {
        handle.offer(&mut exporter, &shared).unwrap();
    }
    // Still in use by both: the share comes back, saying so.
    let shared = match shared.reclaim(Duration::from_millis(50)) {
        Err(SubmitError::Rejected {
            input,
            error: Error::Share(ShareError::StillImported { imports: 2 }),
        }) => input,
        other => panic!("{other:?}"),
    };
    for (thread, go) in threads {
        go.send(()).unwrap();
        assert_eq!(thread.join().unwrap(), vec![6.0; 1000]);
    }
    let mut tensor = shared.reclaim(DEADLINE).unwrap();
    exporter.fill(&mut tensor, 7.0).unwrap();
    assert_eq!(
        download_tensor(&mut exporter, &tensor).unwrap(),
        vec![7.0; 1000]
    );
    drop(tensor);
    for handle in &handles {
        assert!(handle.wait_done(DEADLINE));
    }
    drop(ones);
    freed_down_to(&sim, &mut exporter, baseline);
    no_violations(&sim);
}

#[test]
fn an_exclusive_hand_off_moves_write_access_and_back_mapping_once() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("exclusive");
    let listener = ShareListener::bind(&path).unwrap();
    const ROUNDS: usize = 5;
    let (thread, _go) = importer(&sim, &path, |mut engine, mut link, _| {
        for _ in 0..ROUNDS {
            let mut tensor: DeviceTensor<f32> = link.import_exclusive(&mut engine).unwrap();
            // Written in place by this process, then handed back with no host wait.
            let plus = engine.scale(&tensor, 2.0).unwrap();
            engine.copy_into(&plus, &mut tensor).unwrap();
        }
    });
    let handle = listener.accept(&mut exporter).unwrap();
    let mut tensor = exporter.full(&[256], 1.0f32).unwrap();
    for round in 0..ROUNDS {
        let lent = handle.lend(&mut exporter, tensor).unwrap();
        tensor = lent.wait_back(DEADLINE).unwrap();
        let expected = (2u32 << round) as f32;
        assert_eq!(
            download_tensor(&mut exporter, &tensor).unwrap(),
            vec![expected; 256]
        );
    }
    thread.join().unwrap();
    // The importer mapped the allocation once, and unmapped it when its link went.
    assert_eq!(sim.calls(SimOp::PoolImportPointer), 1);
    assert!(handle.wait_done(DEADLINE));
    drop(tensor);
    exporter.synchronize().unwrap();
    no_violations(&sim);
}

#[test]
fn every_order_of_releases_and_of_the_exporters_drop_frees_after_the_last() {
    // Three importers release in every order, and the exporter drops its handle before, between
    // or after them: the memory is freed once, after the last unmapping, whichever it is.
    let orders = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    for order in orders {
        for drop_at in 0..=3 {
            let sim = SimDevice::new(SimConfig::default());
            let mut exporter = CudaEngine::simulated_on(&sim);
            let baseline = sim.device_live().0;
            let path = socket("orders");
            let listener = ShareListener::bind(&path).unwrap();
            let mut threads = Vec::new();
            let mut handles = Vec::new();
            for _ in 0..3 {
                let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
                    let weights = link.import_read::<u32>(&mut engine).unwrap();
                    go.recv().unwrap();
                    let seen = download_tensor(&mut engine, &weights).unwrap();
                    // Import and link go together: released, then unmapped.
                    drop(weights);
                    seen
                });
                threads.push(Some((thread, go)));
                handles.push(listener.accept(&mut exporter).unwrap());
            }
            let tensor = exporter.full(&[64], 9u32).unwrap();
            let mut shared = Some(exporter.export_tensor(tensor).unwrap());
            for handle in &handles {
                handle
                    .offer(&mut exporter, shared.as_ref().unwrap())
                    .unwrap();
            }
            let live = sim.device_live().0;
            for (step, &who) in order.iter().enumerate() {
                if step == drop_at {
                    drop(shared.take());
                }
                // Nothing is freed while any importer still maps it.
                assert_eq!(
                    sim.device_live().0,
                    live,
                    "order {order:?}, drop at {drop_at}"
                );
                let (thread, go) = threads[who].take().unwrap();
                go.send(()).unwrap();
                assert_eq!(thread.join().unwrap(), vec![9; 64]);
                assert!(handles[who].wait_done(DEADLINE));
            }
            drop(shared);
            freed_down_to(&sim, &mut exporter, baseline);
            no_violations(&sim);
        }
    }
}

#[test]
fn an_importer_killed_with_imports_in_use_counts_as_released_once_its_process_ended() {
    let sim = SimDevice::new(SimConfig::default());
    sim.hold_clock(true);
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("killed");
    let listener = ShareListener::bind(&path).unwrap();
    let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
        let weights = link.import_exclusive::<f32>(&mut engine).unwrap();
        // Queued and not run (the clock is held) when the process is killed.
        let doubled = engine.scale(&weights, 2.0).unwrap();
        go.recv().unwrap();
        // A killed process runs no destructor: everything it held is simply gone.
        std::mem::forget((weights, doubled, link, engine));
    });
    let handle = listener.accept(&mut exporter).unwrap();
    let tensor = exporter.full(&[4096], 1.0f32).unwrap();
    let lent = handle.lend(&mut exporter, tensor).unwrap();
    let lent = match lent.wait_back(Duration::from_millis(100)) {
        Err(SubmitError::Rejected { input, .. }) => input,
        other => panic!("{other:?}"),
    };
    sim.kill_process(handle.pid());
    go.send(()).unwrap();
    let _ = thread.join();
    sim.hold_clock(false);
    assert!(
        handle.wait_done(DEADLINE),
        "the exporter saw the process end"
    );
    let mut tensor = lent.wait_back(DEADLINE).unwrap();
    exporter.fill(&mut tensor, 5.0).unwrap();
    assert_eq!(
        download_tensor(&mut exporter, &tensor).unwrap(),
        vec![5.0; 4096]
    );
    drop(tensor);
    exporter.synchronize().unwrap();
    no_violations(&sim);
}

#[test]
fn an_importer_that_lives_on_holds_what_it_leaked_until_its_process_ends() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("leaked");
    let listener = ShareListener::bind(&path).unwrap();
    let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
        let weights = link.import_read::<f32>(&mut engine).unwrap();
        std::mem::forget(weights);
        go.recv().unwrap();
    });
    let handle = listener.accept(&mut exporter).unwrap();
    let tensor = exporter.full(&[16], 1.0f32).unwrap();
    let shared = exporter.export_tensor(tensor).unwrap();
    handle.offer(&mut exporter, &shared).unwrap();
    go.send(()).unwrap();
    thread.join().unwrap();
    // The importer's process lives (its driver is leaked with the import): nothing comes back.
    assert!(!handle.wait_done(Duration::from_millis(300)));
    let shared = match shared.try_reclaim() {
        Err(SubmitError::Rejected { input, .. }) => input,
        other => panic!("{other:?}"),
    };
    sim.kill_process(handle.pid());
    assert!(handle.wait_done(DEADLINE));
    let tensor = shared.reclaim(DEADLINE).unwrap();
    drop(tensor);
    exporter.synchronize().unwrap();
    no_violations(&sim);
}

/// One exporter and one importer share a tensor read-only, then hand it off exclusively and
/// back, each result checked, with `fault` (the `n`th call of an op, on either side) failing.
/// Returns whether every step succeeded, and the machine.
fn share_once(fault: Option<(SimOp, u64)>) -> (bool, SimDevice) {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("fault");
    let listener = ShareListener::bind(&path).unwrap();
    if let Some((op, n)) = fault {
        sim.fail_nth(op, n, DriverError::LAUNCH_FAILED);
    }
    let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
        link.set_timeout(Some(FAULT_DEADLINE));
        let mut all = true;
        match link.import_read::<f32>(&mut engine) {
            Ok(weights) => {
                all &= download_tensor(&mut engine, &weights).is_ok_and(|v| v == [3.0; 8]);
            }
            Err(_) => all = false,
        }
        let _ = go.recv();
        match link.import_exclusive::<f32>(&mut engine) {
            Ok(mut tensor) => all &= engine.fill(&mut tensor, 4.0).is_ok(),
            Err(_) => all = false,
        }
        all &= engine.synchronize().is_ok();
        drop(link);
        all &= engine.synchronize().is_ok();
        all
    });
    let handle = match listener.accept(&mut exporter) {
        Ok(handle) => handle,
        Err(_) => {
            drop(go);
            let _ = thread.join();
            return (false, sim);
        }
    };
    let mut all = true;
    let tensor = exporter.full(&[8], 3.0f32).unwrap();
    let tensor = match exporter.export_tensor(tensor) {
        Ok(shared) => {
            all &= handle.offer(&mut exporter, &shared).is_ok();
            let _ = go.send(());
            match shared.reclaim(FAULT_DEADLINE) {
                Ok(tensor) => Some(tensor),
                Err(SubmitError::Rejected { input, .. }) => {
                    all = false;
                    drop(input);
                    None
                }
                Err(_) => {
                    all = false;
                    None
                }
            }
        }
        Err(SubmitError::Rejected { input, .. }) => {
            all = false;
            let _ = go.send(());
            Some(input)
        }
        Err(other) => panic!("an export refuses before anything is queued: {other}"),
    };
    if let Some(tensor) = tensor {
        match handle.lend(&mut exporter, tensor) {
            Ok(lent) => match lent.wait_back(FAULT_DEADLINE) {
                Ok(back) => {
                    let seen = download_tensor(&mut exporter, &back);
                    all &= seen.is_ok_and(|v| v == [4.0; 8]);
                }
                Err(_) => all = false,
            },
            Err(_) => all = false,
        }
    }
    all &= thread.join().unwrap_or(false);
    all &= handle.wait_done(FAULT_DEADLINE);
    all &= exporter.synchronize().is_ok();
    (all, sim)
}

#[test]
fn a_fault_at_every_call_of_either_side_is_reported_and_frees_nothing_early() {
    let ops = [
        SimOp::PoolExportToShareableHandle,
        SimOp::PoolExportPointer,
        SimOp::PoolImportFromShareableHandle,
        SimOp::PoolImportPointer,
        SimOp::ImportFreeAsync,
        SimOp::IpcGetEventHandle,
        SimOp::IpcOpenEventHandle,
        SimOp::IpcEventDestroy,
        SimOp::EventRecord,
        SimOp::StreamWait,
    ];
    let (clean, sim) = share_once(None);
    assert!(clean, "the run without a fault");
    no_violations(&sim);
    let mut points = 0;
    let mut reported = 0;
    for op in ops {
        let calls = sim.calls(op);
        assert!(calls > 0, "{op:?} is never called");
        for n in 1..=calls {
            let (all, faulted) = share_once(Some((op, n)));
            let seen = faulted.violations();
            assert!(seen.is_empty(), "{op:?} call {n} failing: {seen:?}");
            points += 1;
            reported += usize::from(!all);
        }
    }
    println!("{points} fault points, {reported} reported as a failed step");
    assert!(reported * 2 >= points, "{reported} of {points} reported");
}
