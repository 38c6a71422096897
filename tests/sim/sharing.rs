//! Device tensors shared between processes, on one simulated machine whose engines are
//! processes of their own (each simulated driver is one), run as threads and joined by the real
//! Unix socket: read-only shares and exclusive hand-offs ordered across processes with no host
//! wait, every order of releases and of the exporter's drop, an importer killed with imports in
//! use, one that lives on holding what it leaked, and a fault at every call of both sides. The
//! device records a violation for any free under a mapping, any use after an unmapping and any
//! unordered access, so each test ends by asking it.

use crate::support::{back, returned};
use cuferry::error::{DriverError, MalformedError, PeerError};
use cuferry::pending::TryWait;
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
        let link = ShareLink::connect(&mut engine, &path)
            .unwrap()
            .with_timeout(DEADLINE);
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
    // Still in use by both: the reclaim comes back in flight, saying so.
    let reclaim = match shared
        .reclaim()
        .wait_for(Duration::from_millis(50))
        .unwrap()
    {
        TryWait::InFlight(reclaim) => reclaim,
        other => panic!("{other:?}"),
    };
    assert_eq!(reclaim.imports(), 2);
    for (thread, go) in threads {
        go.send(()).unwrap();
        assert_eq!(thread.join().unwrap(), vec![6.0; 1000]);
    }
    let mut tensor = back(reclaim.wait_for(DEADLINE).unwrap());
    exporter.fill(&mut tensor, 7.0).unwrap();
    assert_eq!(
        download_tensor(&mut exporter, &tensor).unwrap(),
        vec![7.0; 1000]
    );
    drop(tensor);
    for handle in &handles {
        assert!(returned(handle.departure().wait_for(DEADLINE).unwrap()));
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
        tensor = back(lent.wait_for(DEADLINE).unwrap());
        let expected = (2u32 << round) as f32;
        assert_eq!(
            download_tensor(&mut exporter, &tensor).unwrap(),
            vec![expected; 256]
        );
    }
    thread.join().unwrap();
    // The importer mapped the allocation once, and unmapped it when its link went.
    assert_eq!(sim.calls(SimOp::PoolImportPointer), 1);
    assert!(returned(handle.departure().wait_for(DEADLINE).unwrap()));
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
                assert!(returned(
                    handles[who].departure().wait_for(DEADLINE).unwrap()
                ));
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
    let lent = match lent.wait_for(Duration::from_millis(100)).unwrap() {
        TryWait::InFlight(lent) => lent,
        other => panic!("{other:?}"),
    };
    sim.kill_process(handle.pid());
    go.send(()).unwrap();
    let _ = thread.join();
    sim.hold_clock(false);
    assert!(
        returned(handle.departure().wait_for(DEADLINE).unwrap()),
        "the exporter saw the process end"
    );
    let mut tensor = back(lent.wait_for(DEADLINE).unwrap());
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
    assert!(!returned(
        handle
            .departure()
            .wait_for(Duration::from_millis(300))
            .unwrap()
    ));
    let reclaim = match shared.reclaim().try_wait().unwrap() {
        TryWait::InFlight(reclaim) => reclaim,
        other => panic!("{other:?}"),
    };
    sim.kill_process(handle.pid());
    assert!(returned(handle.departure().wait_for(DEADLINE).unwrap()));
    let tensor = back(reclaim.wait_for(DEADLINE).unwrap());
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
    let (thread, go) = importer(&sim, &path, |mut engine, link, go| {
        let mut link = link.with_timeout(FAULT_DEADLINE);
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
            match shared.reclaim().wait_for(FAULT_DEADLINE) {
                Ok(TryWait::Returned(back)) => Some(back.into_parts()),
                Ok(TryWait::InFlight(reclaim)) => {
                    all = false;
                    drop(reclaim);
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
            Ok(lent) => match lent.wait_for(FAULT_DEADLINE) {
                Ok(TryWait::Returned(back)) => {
                    let seen = download_tensor(&mut exporter, back.tensor());
                    all &= seen.is_ok_and(|v| v == [4.0; 8]);
                }
                Ok(TryWait::InFlight(_)) | Err(_) => all = false,
            },
            Err(_) => all = false,
        }
    }
    all &= thread.join().unwrap_or(false);
    all &= handle
        .departure()
        .wait_for(FAULT_DEADLINE)
        .is_ok_and(returned);
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
        SimOp::GetAddressRange,
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
            // A mapping the driver will not measure is never taken as if it fitted.
            assert!(
                op != SimOp::GetAddressRange || !all,
                "{op:?} call {n} failing went unreported"
            );
            points += 1;
            reported += usize::from(!all);
        }
    }
    println!("{points} fault points, {reported} reported as a failed step");
    assert!(reported * 2 >= points, "{reported} of {points} reported");
}

// Hostile peers (issue 36): identity from the kernel, whole-message deadlines, `Duration::MAX`.

/// The start time of real process `pid` (`/proc/PID/stat`'s 22nd field).
fn start_of(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace()
        .nth(22 - 3)
        .unwrap()
        .parse()
        .unwrap()
}

/// A live process that is not this one: a `sleep` child, killed when dropped.
struct Bystander(std::process::Child);

impl Bystander {
    fn new() -> Self {
        Bystander(
            std::process::Command::new("sleep")
                .arg("60")
                .spawn()
                .unwrap(),
        )
    }
    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Bystander {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The identity refusal `result` holds: what disagreed, what was claimed, what the kernel said.
fn identity_refusal<T: std::fmt::Debug>(result: Result<T, Error>) -> (&'static str, u64, u64) {
    match result {
        Err(Error::Malformed(MalformedError::PeerIdentity {
            what,
            claimed,
            kernel,
        })) => (what, claimed, kernel),
        other => panic!("expected a PeerIdentity refusal, got {other:?}"),
    }
}

#[test]
fn a_greeting_that_names_another_live_process_is_refused() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("liar-pid");
    let listener = ShareListener::bind(&path).unwrap();
    let other = Bystander::new();
    let mut engine = CudaEngine::simulated_on(&sim);
    // The claim is a live process's, start time and all: only the kernel can tell the lie.
    let link = ShareLink::connect_claiming(
        &mut engine,
        &path,
        Some(other.pid()),
        Some(start_of(other.pid())),
        None,
    )
    .unwrap();
    let (what, claimed, kernel) = identity_refusal(listener.accept(&mut exporter));
    assert_eq!(what, "pid");
    assert_eq!(claimed, u64::from(other.pid()));
    assert_eq!(kernel, u64::from(std::process::id()));
    drop(link);
    no_violations(&sim);
}

#[test]
fn a_greeting_with_a_wrong_start_time_or_user_is_refused() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("liar-uid");
    let listener = ShareListener::bind(&path).unwrap();
    let mut engine = CudaEngine::simulated_on(&sim);
    // SAFETY: no preconditions.
    let uid = unsafe { libc::geteuid() };
    let link = ShareLink::connect_claiming(&mut engine, &path, None, None, Some(uid + 1)).unwrap();
    let (what, claimed, kernel) = identity_refusal(listener.accept(&mut exporter));
    assert_eq!(
        (what, claimed, kernel),
        ("user id", u64::from(uid + 1), u64::from(uid))
    );
    drop(link);
    // This process's own pid, with a start time that is not its own (a recycled pid).
    let own = std::process::id();
    let link = ShareLink::connect_claiming(&mut engine, &path, Some(own), Some(1), None).unwrap();
    let (what, claimed, kernel) = identity_refusal(listener.accept(&mut exporter));
    assert_eq!((what, claimed, kernel), ("start time", 1, start_of(own)));
    drop(link);
    // The listener takes an honest importer after them.
    let (thread, _go) = importer(&sim, &path, |_engine, _link, _go| ());
    listener.accept(&mut exporter).unwrap();
    thread.join().unwrap();
}

#[test]
fn a_peer_of_another_user_is_refused_unless_the_listener_allows_it() {
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: making a peer of another user needs root");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    const NOBODY: u32 = 65534;
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    for allow in [false, true] {
        let path = socket("other-user");
        let mut listener = ShareListener::bind(&path).unwrap();
        if allow {
            listener = listener.allow_uid(NOBODY);
        }
        // The caller lets the other user reach the socket.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let child = connect_as(NOBODY, &path);
        let accepted = listener.accept(&mut exporter);
        let mut status = 0;
        // SAFETY: `child` is this test's own child, waited for once.
        unsafe { libc::waitpid(child, &mut status, 0) };
        match accepted {
            Err(Error::Peer(PeerError::OtherUser { uid, allowed })) if !allow => {
                assert_eq!((uid, allowed), (NOBODY, vec![0]));
            }
            // Allowed, it passes the user's check and is refused for its (forged) process.
            Err(Error::Malformed(MalformedError::PeerIdentity { what: "pid", .. })) if allow => {}
            other => panic!("allowed {allow}: {other:?}"),
        }
    }
}

/// Forks a process that becomes user `uid`, connects to `path` and sends a greeting of zeros
/// (its pid 0) naming `uid`, then lingers a moment; returns its pid.
fn connect_as(uid: u32, path: &Path) -> libc::pid_t {
    use std::os::unix::ffi::OsStrExt;
    // Everything is made before the fork: the child makes only async-signal-safe calls.
    let mut frame = b"CFSHARE".to_vec();
    frame.push(2);
    frame.push(4);
    let body_len = 16 + 16 + 4 + 8 + 4 + 16 + 64;
    frame.extend_from_slice(&(body_len as u32).to_le_bytes());
    let mut body = vec![0u8; body_len];
    body[44..48].copy_from_slice(&uid.to_le_bytes());
    frame.extend_from_slice(&body);
    // SAFETY: an all-zero address is valid; its path is set below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (to, &from) in addr.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
        *to = from as libc::c_char;
    }
    // SAFETY: the child makes only async-signal-safe calls on memory made before the fork,
    // and ends with `_exit`.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            if libc::setgid(uid) != 0 || libc::setuid(uid) != 0 {
                libc::_exit(2);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            let size = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            if libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), size) != 0 {
                libc::_exit(3);
            }
            libc::write(fd, frame.as_ptr().cast(), frame.len());
            libc::sleep(1);
            libc::_exit(0);
        }
        assert!(pid > 0, "fork failed");
        pid
    }
}

#[test]
fn the_listening_socket_is_the_owners_alone_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    for umask in [0o000, 0o022, 0o277] {
        // SAFETY: `umask` has no preconditions; it is set back at once.
        let before = unsafe { libc::umask(umask) };
        let path = socket("mode");
        let listener = ShareListener::bind(&path);
        // SAFETY: as above.
        unsafe { libc::umask(before) };
        let listener = listener.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "umask {umask:o}: mode {mode:o}");
        drop(listener);
    }
}

#[test]
fn a_greeting_trickled_byte_by_byte_times_out_as_a_whole() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("trickle");
    let limit = Duration::from_millis(300);
    let listener = ShareListener::bind(&path).unwrap().with_timeout(limit);
    let trickler = {
        let path = path.clone();
        std::thread::spawn(move || {
            use std::io::Write;
            let mut stream = std::os::unix::net::UnixStream::connect(&path).unwrap();
            // A greeting's header and then its body, one byte every 50 ms, for 10 s at most.
            let mut frame = b"CFSHARE\x02\x04".to_vec();
            frame.extend_from_slice(&128u32.to_le_bytes());
            frame.resize(frame.len() + 128, 0);
            for byte in frame.iter().take(200) {
                if stream.write_all(&[*byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let start = std::time::Instant::now();
    let refused = listener.accept(&mut exporter);
    let took = start.elapsed();
    match refused {
        Err(Error::Peer(PeerError::TimedOut {
            what: "a greeting",
            within,
        })) => assert_eq!(within, limit),
        other => panic!("after {took:?}: {other:?}"),
    }
    assert!(took < limit * 2, "the greeting held the accept {took:?}");
    trickler.join().unwrap();
}

#[test]
fn an_offer_that_names_another_process_than_the_kernels_is_refused() {
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let real = socket("real-exporter");
    let listener = ShareListener::bind(&real).unwrap();
    // A relay between the importer and the exporter rewrites the offer's origin to name a
    // live process that is not at the socket's other end.
    let front = socket("relay");
    let relay = UnixListener::bind(&front).unwrap();
    let mut engine = CudaEngine::simulated_on(&sim);
    let mut link = ShareLink::connect(&mut engine, &front)
        .unwrap()
        .with_timeout(DEADLINE);
    let (mut to_importer, _) = relay.accept().unwrap();
    let mut to_exporter = UnixStream::connect(&real).unwrap();
    let frame = |from: &mut UnixStream| {
        let mut header = [0u8; 13];
        from.read_exact(&mut header).unwrap();
        let len = u32::from_le_bytes(header[9..13].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        from.read_exact(&mut body).unwrap();
        (header, body)
    };
    let (header, body) = frame(&mut to_importer);
    to_exporter.write_all(&header).unwrap();
    to_exporter.write_all(&body).unwrap();
    let handle = listener.accept(&mut exporter).unwrap();
    let tensor = exporter.full(&[16], 1.0f32).unwrap();
    let shared = exporter.export_tensor(tensor).unwrap();
    handle.offer(&mut exporter, &shared).unwrap();
    let other = Bystander::new();
    let (header, mut body) = frame(&mut to_exporter);
    // The origin follows the offer's id: host, boot, pid, start.
    body[8 + 32..8 + 36].copy_from_slice(&other.pid().to_le_bytes());
    body[8 + 36..8 + 44].copy_from_slice(&start_of(other.pid()).to_le_bytes());
    to_importer.write_all(&header).unwrap();
    to_importer.write_all(&body).unwrap();
    let (what, claimed, kernel) = identity_refusal(link.import_read::<f32>(&mut engine));
    assert_eq!(what, "pid");
    assert_eq!(claimed, u64::from(other.pid()));
    assert_eq!(kernel, u64::from(std::process::id()));
    // Nothing was mapped.
    assert_eq!(sim.imports_live(), 0);
    drop((link, to_importer, to_exporter));
    let _ = std::fs::remove_file(&front);
}

#[test]
fn duration_max_is_no_deadline_for_every_wait_of_a_share() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    // Nothing imported: the reclaim returns at once.
    let tensor = exporter.full(&[16], 1.0f32).unwrap();
    let shared = exporter.export_tensor(tensor).unwrap();
    let tensor = back(shared.reclaim().wait_for(Duration::MAX).unwrap());
    let path = socket("max");
    let listener = ShareListener::bind(&path)
        .unwrap()
        .with_timeout(Duration::MAX);
    let (thread, _go) = importer(&sim, &path, |mut engine, link, _go| {
        let mut link = link.with_timeout(Duration::MAX);
        let lent = link.import_exclusive::<f32>(&mut engine).unwrap();
        drop(lent);
    });
    let handle = listener.accept(&mut exporter).unwrap();
    let lent = handle.lend(&mut exporter, tensor).unwrap();
    let tensor = back(lent.wait_for(Duration::MAX).unwrap());
    thread.join().unwrap();
    // The importer's link is gone: it holds nothing.
    assert!(returned(
        handle.departure().wait_for(Duration::MAX).unwrap()
    ));
    drop(tensor);
    exporter.synchronize().unwrap();
    no_violations(&sim);
}

#[path = "sharing_relay.rs"]
mod relay;

#[test]
fn an_offer_rewritten_by_a_relay_past_its_allocation_is_refused_and_the_link_goes_on() {
    // A relay between the processes passes the first offer as it was and rewrites the second
    // (of the same tensor, whose mapping the link keeps) from 16 bytes to 4096; the third
    // comes through honest.
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let (importer_end, relay_in) = std::os::unix::net::UnixStream::pair().unwrap();
    let (relay_out, exporter_end) = std::os::unix::net::UnixStream::pair().unwrap();
    let _relay = relay::relay(relay_in, relay_out, |n, body| {
        if n == 1 {
            relay::claim(body, 1024, 4096);
        }
    });
    let machine = sim.clone();
    let thread = std::thread::spawn(move || {
        let mut engine = CudaEngine::simulated_on(&machine);
        let mut link = ShareLink::from_stream(&mut engine, importer_end)
            .unwrap()
            .with_timeout(DEADLINE);
        let first = link.import_read::<f32>(&mut engine).unwrap();
        let rewritten = link.import_read::<f32>(&mut engine).map(|t| t.len());
        let honest = link.import_read::<f32>(&mut engine).unwrap();
        let seen = (
            download_tensor(&mut engine, &first).unwrap(),
            download_tensor(&mut engine, &honest).unwrap(),
        );
        drop((first, honest, link));
        engine.synchronize().unwrap();
        (rewritten, seen)
    });
    let handle = cuferry::share::Importer::from_stream(&mut exporter, exporter_end).unwrap();
    let tensor = exporter.full(&[4], 2.0f32).unwrap();
    let shared = exporter.export_tensor(tensor).unwrap();
    for _ in 0..3 {
        handle.offer(&mut exporter, &shared).unwrap();
    }
    let (rewritten, (first, honest)) = thread.join().unwrap();
    match rewritten {
        Err(Error::Malformed(MalformedError::PastAllocation {
            offered: 4096,
            offset: 0,
            allocation,
        })) => assert!(allocation < 4096, "{allocation}"),
        other => panic!("the rewritten offer: {other:?}"),
    }
    assert_eq!(first, [2.0; 4]);
    assert_eq!(honest, [2.0; 4]);
    assert!(returned(handle.departure().wait_for(DEADLINE).unwrap()));
    let tensor = back(shared.reclaim().wait_for(DEADLINE).unwrap());
    drop(tensor);
    exporter.synchronize().ok();
    no_violations(&sim);
}

#[test]
fn an_importer_past_the_protocol_is_closed_holding_nothing() {
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let release = |id: u64| {
        let mut f = b"CFSHARE\x02\x02".to_vec();
        f.extend_from_slice(&8u32.to_le_bytes());
        f.extend_from_slice(&id.to_le_bytes());
        f
    };
    // After a true greeting: a second greeting, a release, an unmapping and a refusal of
    // tensors never offered, and a goodbye's body past its end.
    let goodbye = {
        let mut f = b"CFSHARE\x02\x07".to_vec();
        f.extend_from_slice(&1u32.to_le_bytes());
        f.push(0);
        f
    };
    let mut unmapped = release(5);
    unmapped[8] = 6;
    let mut refusal = b"CFSHARE\x02\x03".to_vec();
    refusal.extend_from_slice(&9u32.to_le_bytes());
    refusal.extend_from_slice(&[0; 9]);
    for abuse in 0..5 {
        let real = socket("past");
        let listener = ShareListener::bind(&real).unwrap();
        let front = socket("past-relay");
        let relay = UnixListener::bind(&front).unwrap();
        let mut engine = CudaEngine::simulated_on(&sim);
        let link = ShareLink::connect(&mut engine, &front).unwrap();
        let (mut from_importer, _) = relay.accept().unwrap();
        let mut header = [0u8; 13];
        from_importer.read_exact(&mut header).unwrap();
        let len = u32::from_le_bytes(header[9..13].try_into().unwrap()) as usize;
        let mut hello = header.to_vec();
        hello.resize(13 + len, 0);
        from_importer.read_exact(&mut hello[13..]).unwrap();
        let mut to_exporter = UnixStream::connect(&real).unwrap();
        to_exporter.write_all(&hello).unwrap();
        let handle = listener.accept(&mut exporter).unwrap();
        let bytes = match abuse {
            0 => hello.clone(),
            1 => release(999),
            2 => unmapped.clone(),
            3 => refusal.clone(),
            _ => goodbye.clone(),
        };
        to_exporter.write_all(&bytes).unwrap();
        assert!(
            returned(handle.departure().wait_for(DEADLINE).unwrap()),
            "abuse {abuse}: the connection is closed"
        );
        let tensor = exporter.full(&[16], 1.0f32).unwrap();
        let shared = exporter.export_tensor(tensor).unwrap();
        assert!(
            matches!(
                handle.offer(&mut exporter, &shared),
                Err(Error::Peer(PeerError::Closed))
            ),
            "abuse {abuse}: nothing more is offered"
        );
        drop((from_importer, to_exporter, link));
        assert!(returned(shared.reclaim().try_wait().unwrap()));
        let _ = std::fs::remove_file(&front);
    }
    no_violations(&sim);
}

#[test]
fn a_loan_is_waited_for_with_the_verbs_of_every_pending_operation() {
    use cuferry::Pending;
    use cuferry::share::Loan;
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("loan-verbs");
    let listener = ShareListener::bind(&path).unwrap();
    let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
        let mut tensor: DeviceTensor<f32> = link.import_exclusive(&mut engine).unwrap();
        engine.fill(&mut tensor, 8.0).unwrap();
        go.recv().unwrap();
        drop(tensor);
    });
    let handle = listener.accept(&mut exporter).unwrap();
    let tensor = exporter.full(&[32], 1.0f32).unwrap();
    let mut loan: Pending<Loan<f32>> = handle.lend(&mut exporter, tensor).unwrap();
    assert!(!loan.is_ready().unwrap());
    let loan = match loan.try_wait().unwrap() {
        TryWait::InFlight(loan) => loan,
        TryWait::Returned(_) => panic!("back before the importer handed it back"),
    };
    let start = std::time::Instant::now();
    let loan = match loan.wait_for(Duration::from_millis(50)).unwrap() {
        TryWait::InFlight(loan) => loan,
        TryWait::Returned(_) => panic!("back before the importer handed it back"),
    };
    assert!(start.elapsed() >= Duration::from_millis(50));
    go.send(()).unwrap();
    thread.join().unwrap();
    let back = futures_lite::future::block_on(async { loan.await }).unwrap();
    let tensor = back.into_parts();
    assert_eq!(
        download_tensor(&mut exporter, &tensor).unwrap(),
        vec![8.0; 32]
    );
    assert!(returned(handle.departure().wait_for(DEADLINE).unwrap()));
    drop(tensor);
    exporter.synchronize().unwrap();
    no_violations(&sim);
}

#[test]
fn an_awaited_loan_is_woken_by_the_hand_back_not_by_polling() {
    use std::future::{Future, IntoFuture};
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Woken(std::sync::Mutex<Sender<()>>);
    impl Wake for Woken {
        fn wake(self: Arc<Self>) {
            let _ = self.0.lock().unwrap().send(());
        }
    }
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("loan-wake");
    let listener = ShareListener::bind(&path).unwrap();
    let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
        let mut tensor: DeviceTensor<f32> = link.import_exclusive(&mut engine).unwrap();
        engine.fill(&mut tensor, 6.0).unwrap();
        go.recv().unwrap();
        drop(tensor);
    });
    let handle = listener.accept(&mut exporter).unwrap();
    let tensor = exporter.full(&[8], 1.0f32).unwrap();
    let loan = handle.lend(&mut exporter, tensor).unwrap();
    let (tx, woken) = channel();
    let waker = Waker::from(Arc::new(Woken(std::sync::Mutex::new(tx))));
    let mut cx = Context::from_waker(&waker);
    let mut future = loan.into_future();
    assert!(std::pin::Pin::new(&mut future).poll(&mut cx).is_pending());
    // Nothing wakes the task while the importer holds the tensor.
    assert!(woken.recv_timeout(Duration::from_millis(50)).is_err());
    go.send(()).unwrap();
    // The connection's reader wakes it when the hand-back comes, with no poll in between.
    woken.recv_timeout(DEADLINE).unwrap();
    let tensor = match std::pin::Pin::new(&mut future).poll(&mut cx) {
        Poll::Ready(back) => back.unwrap().into_parts(),
        Poll::Pending => panic!("woken before the hand-back was counted"),
    };
    thread.join().unwrap();
    assert_eq!(
        download_tensor(&mut exporter, &tensor).unwrap(),
        vec![6.0; 8]
    );
    drop(tensor);
    exporter.synchronize().unwrap();
    no_violations(&sim);
}

#[test]
fn a_reclaim_stays_readable_in_flight_and_returns_after_the_last_release() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("reclaim-verbs");
    let listener = ShareListener::bind(&path).unwrap();
    let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
        let weights = link.import_read::<f32>(&mut engine).unwrap();
        let seen = download_tensor(&mut engine, &weights).unwrap();
        go.recv().unwrap();
        drop(weights);
        seen
    });
    let handle = listener.accept(&mut exporter).unwrap();
    let tensor = exporter.full(&[16], 3.0f32).unwrap();
    let shared = exporter.export_tensor(tensor).unwrap();
    handle.offer(&mut exporter, &shared).unwrap();
    let mut reclaim = shared.reclaim();
    assert!(!reclaim.is_ready().unwrap());
    let reclaim = match reclaim.wait_for(Duration::from_millis(50)).unwrap() {
        TryWait::InFlight(reclaim) => reclaim,
        TryWait::Returned(_) => panic!("returned while an import is in use"),
    };
    assert_eq!(reclaim.imports(), 1);
    // Still readable here while the importer reads it.
    assert_eq!(
        download_tensor(&mut exporter, reclaim.tensor()).unwrap(),
        vec![3.0; 16]
    );
    go.send(()).unwrap();
    assert_eq!(thread.join().unwrap(), vec![3.0; 16]);
    let mut tensor = reclaim.wait().unwrap().into_parts();
    exporter.fill(&mut tensor, 4.0).unwrap();
    assert_eq!(
        download_tensor(&mut exporter, &tensor).unwrap(),
        vec![4.0; 16]
    );
    let mut departure = handle.departure();
    let departed = futures_lite::future::block_on(async {
        let _ = departure.is_ready();
        departure.await
    });
    departed.unwrap().into_parts();
    drop(tensor);
    exporter.synchronize().unwrap();
    no_violations(&sim);
}

#[test]
fn an_importers_departure_times_out_while_it_holds_a_share() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("departure");
    let listener = ShareListener::bind(&path).unwrap();
    let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
        let weights = link.import_read::<f32>(&mut engine).unwrap();
        go.recv().unwrap();
        drop((weights, link));
    });
    let handle = listener.accept(&mut exporter).unwrap();
    let tensor = exporter.full(&[8], 1.0f32).unwrap();
    let shared = exporter.export_tensor(tensor).unwrap();
    handle.offer(&mut exporter, &shared).unwrap();
    let mut departure = handle.departure();
    assert!(!departure.is_ready().unwrap());
    let departure = match departure.try_wait().unwrap() {
        TryWait::InFlight(departure) => departure,
        TryWait::Returned(_) => panic!("departed while holding a share"),
    };
    let departure = match departure.wait_for(Duration::from_millis(50)).unwrap() {
        TryWait::InFlight(departure) => departure,
        TryWait::Returned(_) => panic!("departed while holding a share"),
    };
    go.send(()).unwrap();
    thread.join().unwrap();
    assert!(returned(departure.wait_for(DEADLINE).unwrap()));
    assert!(returned(shared.reclaim().try_wait().unwrap()));
    exporter.synchronize().unwrap();
    no_violations(&sim);
}

#[test]
fn a_links_timeout_is_set_builder_style_and_bounds_the_wait_for_an_offer() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("link-timeout");
    let listener = ShareListener::bind(&path)
        .unwrap()
        .with_timeout(Duration::from_secs(20));
    let thread = {
        let (sim, path) = (sim.clone(), path.clone());
        std::thread::spawn(move || {
            let mut engine = CudaEngine::simulated_on(&sim);
            let mut link = ShareLink::connect(&mut engine, &path)
                .unwrap()
                .with_timeout(Duration::from_millis(50));
            let start = std::time::Instant::now();
            let none = link.import_read::<f32>(&mut engine);
            (none.map(|t| t.len()), start.elapsed())
        })
    };
    let handle = listener.accept(&mut exporter).unwrap();
    let (none, took) = thread.join().unwrap();
    match none {
        Err(Error::Io(cuferry::error::IoError::Socket { source, .. })) => {
            assert_eq!(source.kind(), std::io::ErrorKind::TimedOut)
        }
        other => panic!("{other:?}"),
    }
    assert!(took >= Duration::from_millis(50), "{took:?}");
    assert!(returned(handle.departure().wait_for(DEADLINE).unwrap()));
}

/// An exported tensor's memory is the exporter's "exported" from the export until the last
/// importer has unmapped it, its tensor gone or not; each importer counts the mapping as
/// "imported" while it maps it.
#[test]
fn exported_and_imported_memory_is_counted_on_both_sides_until_the_last_unmapping() {
    let sim = SimDevice::new(SimConfig::default());
    let mut exporter = CudaEngine::simulated_on(&sim);
    let path = socket("counted");
    let listener = ShareListener::bind(&path).unwrap();
    let (thread, go) = importer(&sim, &path, |mut engine, mut link, go| {
        let weights = link.import_read::<f32>(&mut engine).unwrap();
        let mapped = engine.memory();
        go.recv().unwrap();
        drop(weights);
        drop(link);
        engine.synchronize().unwrap();
        (mapped, engine.memory())
    });
    let handle = listener.accept(&mut exporter).unwrap();
    let tensor = exporter.full(&[1000], 1.0f32).unwrap();
    assert_eq!(exporter.memory().tensors.in_use, 4000);
    let shared = exporter.export_tensor(tensor).unwrap();
    let m = exporter.memory();
    assert_eq!(
        (m.tensors.in_use, m.exported.in_use, m.exported.count),
        (0, 4000, 1)
    );
    assert_eq!(m.device_total.in_use, 4000);
    handle.offer(&mut exporter, &shared).unwrap();
    go.send(()).unwrap();
    let (mapped, unmapped) = thread.join().unwrap();
    assert_eq!((mapped.imported.in_use, mapped.imported.count), (4000, 1));
    assert_eq!(
        mapped.tensors.in_use, 0,
        "an import is not the importer's tensor"
    );
    assert_eq!(
        (unmapped.imported.in_use, unmapped.imported.peak_in_use),
        (0, 4000)
    );
    assert!(returned(handle.departure().wait_for(DEADLINE).unwrap()));
    let tensor = back(shared.reclaim().wait_for(DEADLINE).unwrap());
    assert_eq!(
        exporter.memory().exported.in_use,
        4000,
        "still exported: it is the export's"
    );
    drop(tensor);
    freed_down_to(&sim, &mut exporter, 0);
    let m = exporter.memory();
    assert_eq!(
        (m.exported.in_use, m.tensors.in_use, m.device_total.in_use),
        (0, 0, 0)
    );
    no_violations(&sim);
}
