//! Device tensors shared between two real processes on the one GPU: the shared-weights example's
//! producer and consumers, an importer killed with a kernel reading the exporter's memory, and
//! the measurements of `docs/records/shared-between-processes.md` (import and release beside
//! the raw driver, and the 64 MiB hand-off loop beside the same loop between two engines of one
//! process joined by signals).
//!
//! The other process is this test binary again, running [`child`] with `CUFERRY_SHARE_ROLE`
//! set; without it, [`child`] does nothing.

#[allow(dead_code)]
#[path = "../../examples/shared_weights.rs"]
mod example;
#[path = "../sim/sharing_relay.rs"]
mod relay;

use crate::support::{back, returned};
use cuferry::pending::TryWait;
use cuferry::share::{ShareLink, ShareListener};
use cuferry::{CudaEngine, DeviceTensor, download_tensor};
use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);

fn socket(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cuferry-gpu-{name}-{}.sock", std::process::id()))
}

/// Starts this binary as the other process, in `role`, connecting to `path`; its reports (the
/// lines it prints after `REPORT `) come back through the returned lines.
fn spawn(role: &str, path: &Path) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "sharing::child", "--ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .env("CUFERRY_SHARE_ROLE", role)
        .env("CUFERRY_SHARE_SOCKET", path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// The other process's next report.
fn report(lines: &mut Lines<BufReader<ChildStdout>>) -> String {
    for line in lines.by_ref() {
        let line = line.unwrap();
        // The test harness's own line may run into the first report.
        if let Some(at) = line.find("REPORT ") {
            return line[at + "REPORT ".len()..].to_string();
        }
    }
    panic!("the other process ended without reporting");
}

/// The other process, when `CUFERRY_SHARE_ROLE` names a role; nothing otherwise.
#[test]
#[ignore = "needs a CUDA device"]
fn child() {
    let Ok(role) = std::env::var("CUFERRY_SHARE_ROLE") else {
        return;
    };
    let path = PathBuf::from(std::env::var_os("CUFERRY_SHARE_SOCKET").unwrap());
    let mut engine = CudaEngine::open(0).unwrap();
    if role == "liar" {
        // A greeting that names the parent (the exporter itself), a live process, start
        // time and all: only the kernel's word on the socket tells the lie.
        let parent = std::os::unix::process::parent_id();
        let mut link = ShareLink::connect_claiming(
            &mut engine,
            &path,
            Some(parent),
            Some(start_of(parent)),
            None,
        )
        .unwrap()
        .with_timeout(DEADLINE);
        println!("REPORT greeted {}", std::process::id());
        // Held until the exporter has judged the greeting and closed its end.
        let _ = link.import_read::<f32>(&mut engine);
        return;
    }
    let mut link = ShareLink::connect(&mut engine, &path)
        .unwrap()
        .with_timeout(DEADLINE);
    let (role, arg) = role.split_once(':').unwrap_or((role.as_str(), ""));
    match role {
        "consumer" => {
            let f: Vec<usize> = arg.split('/').map(|x| x.parse().unwrap()).collect();
            let plan = example::Plan {
                consumers: f[1],
                steps: f[2],
                elements: f[3],
            };
            example::consumer(&mut engine, &mut link, f[0], plan, &mut |line| {
                println!("REPORT {line}")
            })
            .unwrap();
        }
        "killed" => {
            let tensor: DeviceTensor<f32> = link.import_exclusive(&mut engine).unwrap();
            // Kernels that read the exporter's memory, queued when the process is killed.
            let mut outputs = Vec::new();
            for _ in 0..200 {
                outputs.push(engine.scale(&tensor, 2.0).unwrap());
            }
            println!("REPORT ready");
            std::thread::sleep(DEADLINE);
        }
        "measure" => {
            let n: usize = arg.parse().unwrap();
            let (mut imports, mut releases) = (Vec::new(), Vec::new());
            for _ in 0..n {
                let start = Instant::now();
                let weights = link.import_read::<f32>(&mut engine).unwrap();
                let imported = start.elapsed();
                let start = Instant::now();
                drop(weights);
                releases.push(start.elapsed());
                imports.push(imported);
            }
            let us = |d: &Duration| d.as_secs_f64() * 1e6;
            println!("REPORT first {:.1}", us(&imports[0]));
            let mut rest: Vec<f64> = imports[1..].iter().map(us).collect();
            rest.sort_by(f64::total_cmp);
            let mut rel: Vec<f64> = releases.iter().map(us).collect();
            rel.sort_by(f64::total_cmp);
            println!(
                "REPORT import {:.1} {:.1}",
                rest[rest.len() / 2],
                rest[rest.len() * 9 / 10]
            );
            println!(
                "REPORT release {:.1} {:.1}",
                rel[rel.len() / 2],
                rel[rel.len() * 9 / 10]
            );
            // The hand-off loop: the consumer reads every tensor it is lent, and hands it back.
            loop {
                let Ok(tensor) = link.import_exclusive::<f32>(&mut engine) else {
                    break;
                };
                let read = engine.scale(&tensor, 1.0).unwrap();
                drop((read, tensor));
            }
        }
        "relayed" => {
            // The second offer comes rewritten by the relay, claiming far more than its
            // allocation holds: refused, and the third (honest) still imports.
            let first = link.import_read::<f32>(&mut engine).unwrap();
            match link.import_read::<f32>(&mut engine) {
                Err(cuferry::Error::Malformed(
                    cuferry::error::MalformedError::PastAllocation {
                        offered,
                        allocation,
                        ..
                    },
                )) => println!("REPORT refused {offered} {allocation}"),
                Err(other) => println!("REPORT error {other}"),
                // Never read: its download would read past the mapping.
                Ok(tensor) => println!("REPORT imported {}", tensor.len()),
            }
            let honest = link.import_read::<f32>(&mut engine).unwrap();
            let first_seen = download_tensor(&mut engine, &first).unwrap();
            let honest_seen = download_tensor(&mut engine, &honest).unwrap();
            println!(
                "REPORT seen {} {}",
                first_seen == [2.0; 4],
                honest_seen == [2.0; 4]
            );
            drop((first, honest, link));
            engine.synchronize().unwrap();
        }
        other => panic!("role {other:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_shared_weights_example_runs_with_two_consumer_processes() {
    let mut engine = CudaEngine::open(0).unwrap();
    let path = socket("weights");
    let listener = ShareListener::bind(&path).unwrap();
    let plan = example::Plan {
        consumers: 2,
        steps: 4,
        elements: 1 << 20,
    };
    let mut children = Vec::new();
    let mut importers = Vec::new();
    for k in 0..plan.consumers {
        let role = format!(
            "consumer:{k}/{}/{}/{}",
            plan.consumers, plan.steps, plan.elements
        );
        children.push(spawn(&role, &path));
        importers.push(listener.accept(&mut engine).unwrap());
    }
    let start = Instant::now();
    example::producer(&mut engine, &importers, plan, &mut |k| {
        Ok(report(&mut children[k].1))
    })
    .unwrap();
    for (mut child, _) in children {
        assert!(child.wait().unwrap().success());
    }
    for importer in &importers {
        assert!(returned(importer.departure().wait_for(DEADLINE).unwrap()));
    }
    engine.synchronize().unwrap();
    println!(
        "two consumer processes, {} steps: {:.1?}",
        plan.steps,
        start.elapsed()
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_importer_killed_with_kernels_reading_counts_as_released_once_it_has_exited() {
    let mut engine = CudaEngine::open(0).unwrap();
    let path = socket("killed");
    let listener = ShareListener::bind(&path).unwrap();
    let (mut child, mut lines) = spawn("killed", &path);
    let importer = listener.accept(&mut engine).unwrap();
    let tensor = engine.full(&[64 << 20], 1.0f32).unwrap();
    let lent = importer.lend(&mut engine, tensor).unwrap();
    assert_eq!(report(&mut lines), "ready");
    let lent = match lent.wait_for(Duration::from_millis(200)).unwrap() {
        TryWait::InFlight(lent) => lent,
        other => panic!("back while the importer holds it: {other:?}"),
    };
    let killed = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        returned(importer.departure().wait_for(DEADLINE).unwrap()),
        "the exporter saw the process end"
    );
    let mut tensor = back(lent.wait_for(DEADLINE).unwrap());
    println!("back {:.1?} after the kill", killed.elapsed());
    engine.fill(&mut tensor, 5.0).unwrap();
    let host = download_tensor(&mut engine, &tensor).unwrap();
    assert!(host.iter().all(|&x| x == 5.0));
    drop(tensor);
    // The engine goes on: fresh memory, written and read.
    let more = engine.full(&[1 << 20], 3.0f32).unwrap();
    assert_eq!(download_tensor(&mut engine, &more).unwrap()[12345], 3.0);
    engine.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn measure_sharing_between_two_processes() {
    const N: usize = 64;
    const STEPS: usize = 300;
    const ELEMENTS: usize = 16 << 20; // 64 MiB of f32
    let mut engine = CudaEngine::open(0).unwrap();

    // The baseline: the same loop between two engines of this process, joined by signals.
    let mut other = CudaEngine::open(0).unwrap();
    let mut x = engine.full(&[ELEMENTS], 0.0f32).unwrap();
    let y = other.full(&[ELEMENTS], 0.0f32).unwrap();
    let mut signalled = |steps: usize| {
        let start = Instant::now();
        for step in 0..steps {
            engine.fill(&mut x, step as f32).unwrap();
            let written = engine.signal().unwrap();
            other.wait_signal(&written).unwrap();
            drop(other.scale(&y, 1.0).unwrap());
            let read = other.signal().unwrap();
            engine.wait_signal(&read).unwrap();
        }
        engine.synchronize().unwrap();
        start.elapsed() / steps as u32
    };
    signalled(20);
    let baseline = signalled(STEPS);
    drop(other);

    let path = socket("measure");
    let listener = ShareListener::bind(&path).unwrap();
    let (mut child, mut lines) = spawn(&format!("measure:{N}"), &path);
    let importer = listener.accept(&mut engine).unwrap();
    let mut shared = Vec::new();
    for i in 0..N {
        let tensor = engine.full(&[1 << 18], i as f32).unwrap();
        let tensor = engine.export_tensor(tensor).unwrap();
        importer.offer(&mut engine, &tensor).unwrap();
        shared.push(tensor);
    }
    let first = report(&mut lines);
    let import = report(&mut lines);
    let release = report(&mut lines);
    let mut tensor = x;
    let mut handed = |steps: usize, mut tensor: DeviceTensor<f32>| {
        let start = Instant::now();
        for step in 0..steps {
            engine.fill(&mut tensor, step as f32).unwrap();
            let lent = importer.lend(&mut engine, tensor).unwrap();
            tensor = back(lent.wait_for(DEADLINE).unwrap());
        }
        engine.synchronize().unwrap();
        (start.elapsed() / steps as u32, tensor)
    };
    (_, tensor) = handed(20, tensor);
    let (per_step, tensor) = handed(STEPS, tensor);
    drop(importer);
    drop(listener);
    drop((tensor, shared));
    // The consumer's next import fails once the socket ends; then it exits.
    let _ = child.kill();
    child.wait().unwrap();
    let mib = (ELEMENTS * 4) as f64 / (1 << 20) as f64;
    let rate = |d: Duration| mib / 1024.0 / d.as_secs_f64();
    println!("sharing: first import (pool and event too) {first} us");
    println!("sharing: import of a fresh allocation: median, p90 {import} us");
    println!("sharing: release: median, p90 {release} us");
    println!(
        "sharing: 64 MiB hand-off loop: {:.1} us per step ({:.1} GiB/s); signals between two \
         engines of one process: {:.1} us per step ({:.1} GiB/s); ratio {:.3}",
        per_step.as_secs_f64() * 1e6,
        rate(per_step),
        baseline.as_secs_f64() * 1e6,
        rate(baseline),
        baseline.as_secs_f64() / per_step.as_secs_f64()
    );
}

/// The start time of process `pid` (`/proc/PID/stat`'s 22nd field).
fn start_of(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace()
        .nth(22 - 3)
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_importer_that_lies_about_its_pid_is_refused_by_the_kernels_word() {
    let mut engine = CudaEngine::open(0).unwrap();
    let path = socket("liar");
    let listener = ShareListener::bind(&path).unwrap();
    let (mut child, mut lines) = spawn("liar", &path);
    let greeted = report(&mut lines);
    let liar: u32 = greeted.strip_prefix("greeted ").unwrap().parse().unwrap();
    match listener.accept(&mut engine) {
        Err(cuferry::Error::Malformed(cuferry::error::MalformedError::PeerIdentity {
            what,
            claimed,
            kernel,
        })) => {
            assert_eq!(what, "pid");
            assert_eq!(claimed, u64::from(std::process::id()));
            assert_eq!(kernel, u64::from(liar));
            println!("refused: the greeting named {claimed}, the kernel {kernel}");
        }
        other => panic!("the lying greeting was not refused: {other:?}"),
    }
    assert!(child.wait().unwrap().success());
    // The exporter goes on.
    let tensor = engine.full(&[1 << 20], 3.0f32).unwrap();
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap()[7], 3.0);
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_offer_rewritten_by_a_relay_past_its_allocation_is_refused_in_the_importer_process() {
    // The importer process connects to a relay, which passes the exporter's first offer as it
    // was and rewrites the second (of the same 16-byte tensor, whose mapping the importer
    // keeps) to claim 4 MiB; the third comes through honest.
    let mut engine = CudaEngine::open(0).unwrap();
    let path = socket("relayed");
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let (mut child, mut lines) = spawn("relayed", &path);
    let (from_child, _) = listener.accept().unwrap();
    let (relay_out, exporter_end) = std::os::unix::net::UnixStream::pair().unwrap();
    let _relay = relay::relay(from_child, relay_out, |n, body| {
        if n == 1 {
            relay::claim(body, 1 << 20, 4 << 20);
        }
    });
    let importer = cuferry::share::Importer::from_stream(&mut engine, exporter_end).unwrap();
    let tensor = engine.full(&[4], 2.0f32).unwrap();
    let shared = engine.export_tensor(tensor).unwrap();
    for _ in 0..3 {
        importer.offer(&mut engine, &shared).unwrap();
    }
    let refused = report(&mut lines);
    let seen = report(&mut lines);
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_file(&path);
    println!("relayed offer: {refused}");
    let mut words = refused.split(' ');
    assert_eq!(words.next(), Some("refused"), "{refused}");
    assert_eq!(words.next(), Some("4194304"), "{refused}");
    let allocation: u64 = words.next().unwrap().parse().unwrap();
    assert!(allocation < 4 << 20, "{refused}");
    assert_eq!(seen, "seen true true");
    assert!(returned(importer.departure().wait_for(DEADLINE).unwrap()));
    let tensor = back(shared.reclaim().wait_for(DEADLINE).unwrap());
    // The importer's refusal is reported at the exporter's next boundary.
    let _ = engine.flush();
    assert_eq!(download_tensor(&mut engine, &tensor).unwrap(), [2.0; 4]);
    drop(tensor);
    let _ = engine.synchronize();
}
