//! The panic sweep: a mixed workload over every route (the blocking routes at every band, the
//! pending and registered routes, the peer routes and a collective between two engines, a
//! prepared program, kernels, a signal, teardown) with a panic inside the driver at every driver
//! call in turn: once before the call takes effect, and once after (the copy queued, the event
//! recorded, and then the panic). After each run: no data that came back was wrong, nothing was
//! freed or reused under queued work (the simulator's violations), both engines serve the next
//! transfers correctly, and teardown leaves at most what the panic leaked live.
//!
//! The staged routes hand their host copies to the process's copy threads, whose number is fixed
//! for the process: the sweep runs in child processes of this test binary, one with two copy
//! threads and one with four, so the parallel paths are swept whatever the machine. The two
//! children run at once.

use cuferry::graph::{GraphCompiler, Input, TracedTensor};
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, DType, Error, PinnedHostBuffer, RegisteredBuffer,
    collective::{Communicator, ReduceOp},
    download_pending, download_tensor, download_tensor_into, peer,
    staging::StagingConfig,
    upload_pending, upload_tensor,
};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::Command;
use std::sync::{Mutex, mpsc};
use std::time::Duration;

/// The child's variable: how many copy threads its sweep runs with.
const CHILD: &str = "CUFERRY_PANIC_SWEEP_THREADS";

/// Every driver operation the workload reaches.
const OPS: [SimOp; 20] = [
    SimOp::Alloc,
    SimOp::Free,
    SimOp::CopyHtoD,
    SimOp::CopyDtoH,
    SimOp::CopyDtoD,
    SimOp::EventCreate,
    SimOp::EventRecord,
    SimOp::EventQuery,
    SimOp::EventSynchronize,
    SimOp::HostAlloc,
    SimOp::HostRegister,
    SimOp::HostUnregister,
    SimOp::StreamSynchronize,
    SimOp::ModuleLoad,
    SimOp::Launch,
    SimOp::GraphLaunch,
    SimOp::StreamWait,
    SimOp::PeerEnable,
    SimOp::CopyPeer,
    SimOp::Collective,
];

/// Per-index distinct values, never zero. Each (length, salt) is made once per process and
/// copied out after: the sweep runs the workload hundreds of times, and making megabytes of
/// values element by element in an unoptimized test build was most of its time.
fn distinct(n: usize, salt: u32) -> Vec<u32> {
    type Made = Vec<((usize, u32), Vec<u32>)>;
    static MADE: Mutex<Made> = Mutex::new(Vec::new());
    let mut made = MADE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, values)) = made.iter().find(|(key, _)| *key == (n, salt)) {
        return values.clone();
    }
    let values: Vec<u32> = (0..n as u32)
        .map(|i| (i ^ salt).wrapping_mul(2_654_435_761) | 1)
        .collect();
    made.push(((n, salt), values.clone()));
    values
}

/// What the workload found wrong (it records rather than asserts: an assertion's panic would
/// look like the injected one).
type Wrong = Mutex<Vec<String>>;

fn expect<T: PartialEq + std::fmt::Debug>(wrong: &Wrong, what: &str, got: &[T], want: &[T]) {
    if got != want {
        wrong.lock().unwrap().push(format!("{what}: wrong data"));
    }
}

/// The staging settings the sweep runs with: 1 MiB slots four deep, so 2 MiB transfers take the
/// one-hand-off paths (a download in marked parts of 512 KiB), and 6 MiB the chunk pipeline (a
/// fresh download's pages populated by half the copy threads).
fn staging() -> StagingConfig {
    let mut config = StagingConfig::default();
    config.chunk_bytes = 1 << 20;
    config.cutoff_bytes = 64 << 10;
    config.ring_depth = 4;
    config
}

/// The workload; stops at the first error, dropping what it holds, as a caller's `?` would.
fn workload(a: &mut CudaEngine, b: &mut CudaEngine, wrong: &Wrong) -> Result<(), Error> {
    a.set_staging_config(staging())?;
    b.set_staging_config(staging())?;
    // Blocking routes, every band: the scalar slot, one staged copy, one hand-off, the pipeline.
    for (n, salt) in [(3, 1), (3000, 2), (512 << 10, 3), (1536 << 10, 4)] {
        let data = distinct(n, salt);
        let t = upload_tensor(a, &data, &[n])?;
        expect(wrong, "download_tensor", &download_tensor(a, &t)?, &data);
        let reused = download_tensor_into(a, &t, Vec::with_capacity(n))?;
        expect(wrong, "download_tensor_into", &reused, &data);
    }
    // A kernel and a device copy on the stream.
    let x = upload_tensor(a, &distinct(4096, 5), &[4096])?;
    let sum = a.add(&x, &x)?;
    let want: Vec<u32> = distinct(4096, 5)
        .iter()
        .map(|v| v.wrapping_add(*v))
        .collect();
    expect(wrong, "add", &download_tensor(a, &sum)?, &want);
    let copy = a.copy_tensor(&x)?;

    // Pending routes: submit, wait, resubmit, detach; a registered buffer.
    let data = distinct(4096, 6);
    let buffer = PinnedHostBuffer::from_slice(a, &data)?;
    let dest = a.alloc_tensor::<u32>(&[4096])?;
    let returned = upload_pending(a, buffer, dest)
        .map_err(|e| e.into_error())?
        .wait()?;
    drop(returned.resubmit(a).map_err(|e| e.into_error())?); // detached in flight
    let buffer = PinnedHostBuffer::<u32>::new(a, 4096)?;
    let back = download_pending(a, copy, buffer)
        .map_err(|e| e.into_error())?
        .wait()?;
    expect(
        wrong,
        "download_pending",
        back.buffer().as_slice(),
        &distinct(4096, 5),
    );
    drop(back);
    let registered = RegisteredBuffer::register(a, distinct(2048, 7))?;
    let dest = a.alloc_tensor::<u32>(&[2048])?;
    let landed = upload_pending(a, registered, dest)
        .map_err(|e| e.into_error())?
        .wait()?;
    drop(landed);

    // A prepared program, run twice.
    let t = TracedTensor::input_symbolic_shape(DType::U32, 1);
    let y = (&(&t * &t)? + &t)?;
    let program =
        GraphCompiler::new().compile_with_input_specs(&[&y], &[(&t, DType::U32, &[64])])?;
    let mut prepared = a.prepare(&program)?;
    let input = upload_tensor(a, &distinct(64, 8), &[64])?;
    for _ in 0..2 {
        let out = a.run(&mut prepared, &[Input::from(&input)])?;
        let want: Vec<u32> = distinct(64, 8)
            .iter()
            .map(|v| v.wrapping_mul(*v).wrapping_add(*v))
            .collect();
        let got = out[0].as_tensor::<u32>().expect("a u32 output");
        expect(wrong, "prepared run", &download_tensor(a, got)?, &want);
    }
    drop(prepared);

    // Between the engines: a signal, the peer routes, a collective.
    let signal = a.signal()?;
    b.wait_signal(&signal)?;
    drop(signal);
    let src = upload_tensor(a, &distinct(5000, 9), &[5000])?;
    let there = peer::copy(a, &src, b)?;
    expect(
        wrong,
        "peer::copy",
        &download_tensor(b, &there)?,
        &distinct(5000, 9),
    );
    let mut into = b.alloc_tensor::<u32>(&[5000])?;
    peer::copy_into(a, &src, b, &mut into)?;
    expect(
        wrong,
        "peer::copy_into",
        &download_tensor(b, &into)?,
        &distinct(5000, 9),
    );
    let returned = peer::copy_pending(a, src, b, into)
        .map_err(|e| e.into_error())?
        .wait()?;
    drop(returned);
    let comm = Communicator::new(&mut [&mut *a, &mut *b])?;
    let ta = upload_tensor(a, &distinct(300, 10), &[300])?;
    let tb = upload_tensor(b, &distinct(300, 11), &[300])?;
    let reduced = comm
        .group()
        .all_reduce(vec![ta, tb], ReduceOp::Max)
        .submit(&mut [&mut *a, &mut *b])?
        .wait()?
        .into_parts();
    let want: Vec<u32> = distinct(300, 10)
        .iter()
        .zip(distinct(300, 11))
        .map(|(p, q)| (*p).max(q))
        .collect();
    expect(
        wrong,
        "all_reduce",
        &download_tensor(b, &reduced[1])?,
        &want,
    );
    drop(reduced);
    drop(comm);
    #[cfg(feature = "safetensors")]
    checkpoints(a, wrong)?;
    a.flush()?;
    b.flush()?;
    a.synchronize()?;
    b.synchronize()
}

/// Checkpoint files: a save, a load handing each tensor over (each copied on the device at
/// once), a load that converts a tensor on the device, one that takes columns of a tensor and
/// converts them, and file ranges both ways, with three readers and writers on three slots.
#[cfg(feature = "safetensors")]
fn checkpoints(a: &mut CudaEngine, wrong: &Wrong) -> Result<(), Error> {
    use cuferry::AnyTensor;
    use cuferry::checkpoint::{self, LoadOptions, SaveOptions};
    let dir = scratch_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    let large = distinct(400_000, 12); // 1.5 MiB: two slots
    let grid_data = distinct(300_000, 14); // [600, 500]: 1.1 MiB
    let tensors = [
        AnyTensor::from(upload_tensor(a, &large, &[400_000])?),
        AnyTensor::from(upload_tensor(a, &distinct(3000, 13), &[3000])?),
        AnyTensor::from(upload_tensor(a, &[7u8; 7], &[7])?),
        AnyTensor::from(upload_tensor(a, &grid_data, &[600, 500])?),
    ];
    let named: [(&str, &dyn checkpoint::SaveTensor); 4] = [
        ("large", &tensors[0]),
        ("small", &tensors[1]),
        ("tiny", &tensors[2]),
        ("matrix", &tensors[3]),
    ];
    let options = SaveOptions::new().writers(3).staging_bytes(3 << 20);
    checkpoint::save_with(a, &named, &path, options)?;
    drop(tensors);
    let mut copies = Vec::new();
    let options = LoadOptions::new().readers(3).staging_bytes(3 << 20);
    checkpoint::load_each(a, &path, options, |a, name, tensor| {
        let copy = match tensor.as_typed::<u32>() {
            Some(t) => AnyTensor::from(a.copy_tensor(t)?),
            None => AnyTensor::from(a.copy_tensor(tensor.as_typed::<u8>().expect("u32 or u8"))?),
        };
        copies.push((name, copy));
        Ok(())
    })?;
    let (_, large_copy) = copies.iter().find(|(n, _)| n == "large").expect("loaded");
    let back = download_tensor(a, large_copy.as_typed::<u32>().expect("a u32 tensor"))?;
    expect(wrong, "checkpoint::load_each", &back, &large);
    // A file of small tensors, landed: its data copied into one allocation while the header is
    // parsed, each tensor a part of it.
    let norms: Vec<Vec<u32>> = (0..30u32).map(|i| distinct(50, 20 + i)).collect();
    let bytes: Vec<Vec<u8>> = (norms.iter())
        .map(|n| n.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = (bytes.iter().enumerate()).map(|(i, b)| {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![50], b);
        (format!("norm.{i:02}"), view.expect("a valid view"))
    });
    let small_path = dir.join("norms.safetensors");
    safetensors::serialize_to_file(views, None, &small_path).unwrap();
    let landed = checkpoint::load_with(a, &small_path, LoadOptions::new().readers(3))?;
    let norm = landed.get("norm.17").expect("loaded").as_typed::<u32>();
    expect(
        wrong,
        "a landed load",
        &download_tensor(a, norm.expect("a u32 tensor"))?,
        &norms[17],
    );
    drop(landed);
    // A load that converts one tensor on the device (a cast queued after its copies).
    let options = LoadOptions::new()
        .readers(3)
        .staging_bytes(3 << 20)
        .select(|name| name == "small")
        .convert(|_, _| cuferry::DType::F32);
    let converted = checkpoint::load_with(a, &path, options)?;
    let small = converted.get("small").expect("loaded").as_typed::<f32>();
    let want_small: Vec<f32> = distinct(3000, 13).iter().map(|&v| v as f32).collect();
    expect(
        wrong,
        "a converting load",
        &download_tensor(a, small.expect("an f32 tensor"))?,
        &want_small,
    );
    // A load that takes columns of a tensor, one read per row, and converts them.
    let options = LoadOptions::new()
        .readers(3)
        .staging_bytes(3 << 20)
        .select(|name| name == "matrix")
        .slices(|_, _| Ok(checkpoint::Slice::Columns(100..350)))
        .convert(|_, _| cuferry::DType::F32);
    let sliced = checkpoint::load_with(a, &path, options)?;
    let grid = sliced.get("matrix").expect("loaded").as_typed::<f32>();
    let want_grid: Vec<f32> = (0..600)
        .flat_map(|r| (100..350).map(move |c| r * 500 + c))
        .map(|i| grid_data[i] as f32)
        .collect();
    expect(
        wrong,
        "a sliced load",
        &download_tensor(a, grid.expect("an f32 tensor"))?,
        &want_grid,
    );
    let want: Vec<u8> = large.iter().flat_map(|v| v.to_le_bytes()).collect();
    let file = std::fs::File::open(&path).unwrap();
    let mut range = a.alloc_tensor::<u8>(&[want.len()])?;
    // The large tensor's bytes come first, right after the header (the format's order).
    let header = 8 + u64::from_le_bytes(std::fs::read(&path).unwrap()[..8].try_into().unwrap());
    checkpoint::read_into(a, &path, &file, header, &mut range)?;
    expect(
        wrong,
        "checkpoint::read_into",
        &download_tensor(a, &range)?,
        &want,
    );
    let out = dir.join("range");
    let writer = std::fs::File::create(&out).unwrap();
    checkpoint::write_from(a, &range, &out, &writer, 3)?;
    expect(
        wrong,
        "checkpoint::write_from",
        &std::fs::read(&out).unwrap()[3..],
        &want,
    );
    Ok(())
}

/// Whether an engine still serves transfers correctly at every band: every upload first (through
/// the staging slots, before any download's wait could run a stale copy to completion), then
/// every download.
fn serves(engine: &mut CudaEngine) -> Result<(), String> {
    let sizes = [(3000, 22), (512 << 10, 23), (1536 << 10, 24), (3, 21)];
    let mut uploaded = Vec::new();
    for (n, salt) in sizes {
        let data = distinct(n, salt);
        let t = upload_tensor(engine, &data, &[n])
            .map_err(|e| format!("an upload of {n} after the panic failed: {e}"))?;
        uploaded.push((t, data));
    }
    for (t, data) in uploaded {
        let n = data.len();
        let back = download_tensor(engine, &t)
            .map_err(|e| format!("a download of {n} after the panic failed: {e}"))?;
        if back != data {
            return Err(format!(
                "a transfer of {n} after the panic returned wrong data"
            ));
        }
    }
    Ok(())
}

/// A machine of two simulated devices, engines on both, released pinned memory freed at once
/// (so a release under a queued copy shows as a violation, or as wrong data later).
fn machine() -> (SimDevice, CudaEngine, CudaEngine) {
    let sim = SimDevice::new(SimConfig {
        devices: 2,
        ..SimConfig::default()
    });
    let mut a = CudaEngine::simulated_on_device(&sim, 0).unwrap();
    let mut b = CudaEngine::simulated_on_device(&sim, 1).unwrap();
    a.set_pinned_pool_budget(0).unwrap();
    b.set_pinned_pool_budget(0).unwrap();
    (sim, a, b)
}

/// One run with a panic armed at `op`'s call `n`, after the call took effect when `after`.
fn run(op: SimOp, n: u64, after: bool) -> Result<bool, String> {
    let (sim, mut a, mut b) = machine();
    if after {
        sim.panic_after_nth(op, n);
    } else {
        sim.panic_nth(op, n);
    }
    let wrong = Wrong::default();
    let in_workload = catch_unwind(AssertUnwindSafe(|| {
        let _ = workload(&mut a, &mut b, &wrong);
    }))
    .is_err();
    sim.clear_faults();
    if let Some(what) = wrong.lock().unwrap().first() {
        return Err(what.clone());
    }
    if in_workload {
        // At once, with no host barrier first: a staging slot released under a copy still
        // queued into it is reused here, and the stale copy lands over the new bytes.
        serves(&mut a)?;
        serves(&mut b)?;
        // Failures the panic left behind may be reported once; then the engines are clean.
        let _ = (a.synchronize(), b.synchronize());
        a.synchronize()
            .map_err(|e| format!("a synchronize failed: {e}"))?;
        b.synchronize()
            .map_err(|e| format!("b synchronize failed: {e}"))?;
    }
    let retained = a.retirement_stats().retained + b.retirement_stats().retained;
    let teardown = catch_unwind(AssertUnwindSafe(move || {
        drop(a);
        drop(b);
    }));
    if !in_workload && teardown.is_ok() {
        // The clean pass made more such calls than this one (a wait the copy threads' timing
        // made unnecessary): nothing to check.
        return Ok(false);
    }
    sim.advance_all();
    let violations = sim.violations();
    if !violations.is_empty() {
        return Err(format!("violations: {violations:?}"));
    }
    // A panic leaks what its route held (at most a ring of slots, a pending transfer's buffer
    // and tensor, a program's arena); everything else is released.
    let (pinned, _) = sim.pinned_live();
    let (device, _) = sim.device_live();
    let bound = retained + staging().ring_depth + 4;
    if in_workload && (pinned > bound || device > bound) {
        return Err(format!(
            "after teardown {pinned} pinned and {device} device allocations live, {retained} \
             retained"
        ));
    }
    Ok(true)
}

/// How often each operation runs in one clean pass, teardown included.
fn clean_calls() -> Vec<u64> {
    let (sim, mut a, mut b) = machine();
    let wrong = Wrong::default();
    workload(&mut a, &mut b, &wrong).expect("the clean workload");
    assert!(wrong.lock().unwrap().is_empty(), "{:?}", wrong.lock());
    drop((a, b));
    OPS.iter().map(|&op| sim.calls(op)).collect()
}

/// The checkpoint files' folder: one per child process, shared by its runs, removed when its
/// sweep ends.
fn scratch_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("cuferry-panic-sweep-{}", std::process::id()))
}

/// The sweep itself, in a process whose copy pool has `threads` threads.
fn sweep(threads: usize) {
    cuferry::staging::set_copy_threads(threads).unwrap();
    assert_eq!(cuferry::staging::copy_threads(), threads);
    let counts = clean_calls();
    for (op, &count) in OPS.iter().zip(&counts) {
        assert!(count > 0, "the workload never calls {op:?}");
    }
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        // The injected panics are expected; anything else is reported.
        if !info.to_string().contains("simulated driver panic") {
            hook(info);
        }
    }));
    let (mut runs, mut panicked) = (0, 0);
    let mut failures = Vec::new();
    for (&op, &count) in OPS.iter().zip(&counts) {
        for n in 1..=count {
            for after in [false, true] {
                // In a thread of its own, so a deadlock shows as a failure, not a hang.
                let (done, result) = mpsc::channel();
                std::thread::spawn(move || {
                    let _ = done.send(run(op, n, after));
                });
                let when = if after { "after" } else { "in" };
                match result.recv_timeout(Duration::from_secs(60)) {
                    Ok(Ok(hit)) => panicked += usize::from(hit),
                    Ok(Err(what)) => failures.push(format!("a panic {when} {op:?} #{n}: {what}")),
                    Err(_) => failures.push(format!("a panic {when} {op:?} #{n}: deadlock")),
                }
                runs += 1;
            }
        }
    }
    let _ = std::fs::remove_dir_all(scratch_dir());
    assert!(
        failures.is_empty(),
        "{} of {runs} runs with {threads} copy threads failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // Timing may save a wait or two near the end of a pass; every other armed call is made.
    assert!(
        panicked + 8 >= runs,
        "only {panicked} of {runs} armed calls were made"
    );
    println!("panic sweep: {runs} runs with {threads} copy threads, {panicked} panicked");
}

/// Runs the sweep in child processes, with two copy threads and with four.
#[test]
fn a_panic_at_every_driver_call_leaks_never_releases_with_two_and_four_copy_threads() {
    if let Ok(threads) = std::env::var(CHILD) {
        sweep(threads.parse().expect("a thread count"));
        return;
    }
    let me = std::env::current_exe().unwrap();
    let name = "a_panic_at_every_driver_call_leaks_never_releases_with_two_and_four_copy_threads";
    // Both children at once: each sweep is one thread of runs, so on two cores the two take
    // the time of one.
    let children: Vec<_> = [2, 4]
        .into_iter()
        .map(|threads| {
            let child = Command::new(&me)
                .args(["--exact", name, "--nocapture", "--test-threads=1"])
                .env(CHILD, threads.to_string())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            (threads, child)
        })
        .collect();
    for (threads, child) in children {
        let child = child.wait_with_output().unwrap();
        let out = String::from_utf8_lossy(&child.stdout);
        let err = String::from_utf8_lossy(&child.stderr);
        assert!(
            child.status.success() && out.contains("panic sweep:"),
            "the sweep with {threads} copy threads failed:\n{out}\n{err}"
        );
        println!(
            "{}",
            out.lines().find(|l| l.contains("panic sweep:")).unwrap()
        );
    }
}
