//! Weights shared between processes on one GPU: a producer and the consumers it starts.
//!
//! ```text
//! cargo run --release --example shared_weights                       # 2 consumers, 3 steps
//! cargo run --release --example shared_weights -- --consumers 4 --steps 5
//! cargo run --example shared_weights --features sim -- --simulated
//! ```
//!
//! The producer makes a set of weight tensors on GPU 0, binds a sharing socket, and starts
//! `--consumers` copies of itself as consumer processes. At every step it shares every tensor
//! read-only with every consumer; each consumer imports them (no copy: the producer's memory,
//! mapped), computes on them on its own engine, reports a checksum, and releases them. Between
//! steps the producer takes the first tensor back once every consumer has released it, and
//! hands it exclusively to one consumer, which doubles it in place and hands it back; the
//! producer checks the update and shares the new weights at the next step. Every checksum is
//! checked against the host's arithmetic; the producer exits 0 when all were right.
//!
//! `--simulated` (feature `sim`) runs the consumers as threads of one process on a simulated
//! machine (a simulated machine lives in one process), through the same socket and the same
//! calls.

use cuferry::pending::{Operation, TryWait};
use cuferry::share::{Exported, Importer, ShareLink, ShareListener};
use cuferry::{CudaEngine, DeviceTensor, Pending, download_tensor};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The weight tensors: tensor `i` holds `ELEMENTS` elements, each `i + 1` at the start.
const TENSORS: usize = 4;
/// Elements per tensor (4 MiB of `f32`).
const ELEMENTS: usize = 1 << 20;
/// How long the producer waits for a release or a hand-back.
const DEADLINE: Duration = Duration::from_secs(60);

/// The plan both sides follow.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    pub consumers: usize,
    pub steps: usize,
    pub elements: usize,
}

/// The value every element of tensor `i` holds at step `step`: the first tensor doubles at
/// every hand-off between steps.
fn value(i: usize, step: usize) -> f32 {
    if i == 0 {
        (1u32 << step) as f32
    } else {
        (i + 1) as f32
    }
}

/// The checksum a consumer reports at `step`: the sum of every element of every tensor, each
/// halved on the device first.
fn checksum(plan: &Plan, step: usize) -> f64 {
    (0..TENSORS)
        .map(|i| f64::from(value(i, step)) / 2.0 * plan.elements as f64)
        .sum()
}

/// Consumer `me`'s part, on `engine`, through `link`: at every step, import the tensors,
/// compute, report, release; and when its turn comes, take the first tensor exclusively and
/// double it.
pub(crate) fn consumer(
    engine: &mut CudaEngine,
    link: &mut ShareLink,
    me: usize,
    plan: Plan,
    report: &mut dyn FnMut(String),
) -> Result<(), BoxError> {
    for step in 0..plan.steps {
        let weights = (0..TENSORS)
            .map(|_| link.import_read::<f32>(engine))
            .collect::<Result<Vec<_>, _>>()?;
        let mut sum = 0.0f64;
        for w in &weights {
            let halved = engine.scale(w, 0.5)?;
            sum += download_tensor(engine, &halved)?
                .iter()
                .map(|&x| f64::from(x))
                .sum::<f64>();
        }
        drop(weights); // released: the producer may write them again
        report(format!("sum {step} {sum}"));
        if step + 1 < plan.steps && step % plan.consumers == me {
            let mut first: DeviceTensor<f32> = link.import_exclusive(engine)?;
            let doubled = engine.scale(&first, 2.0)?;
            engine.copy_into(&doubled, &mut first)?;
            drop(first); // handed back, after the write
        }
    }
    Ok(())
}

/// The producer's part, on `engine`, with one [`Importer`] per consumer; `reports(k)` yields
/// consumer `k`'s next report.
pub(crate) fn producer(
    engine: &mut CudaEngine,
    importers: &[Importer],
    plan: Plan,
    reports: &mut dyn FnMut(usize) -> Result<String, BoxError>,
) -> Result<(), BoxError> {
    let mut weights: Vec<Exported<f32>> = (0..TENSORS)
        .map(|i| {
            let tensor = engine.full(&[plan.elements], value(i, 0))?;
            Ok(engine.export_tensor(tensor).map_err(|e| e.to_string())?)
        })
        .collect::<Result<_, BoxError>>()?;
    for step in 0..plan.steps {
        for importer in importers {
            for w in &weights {
                importer.offer(engine, w)?;
            }
        }
        let expected = checksum(&plan, step);
        for k in 0..importers.len() {
            let line = reports(k)?;
            let got: f64 = line
                .strip_prefix(&format!("sum {step} "))
                .ok_or_else(|| format!("consumer {k} reported {line:?} at step {step}"))?
                .parse()?;
            if got != expected {
                return Err(
                    format!("consumer {k}, step {step}: {got}, expected {expected}").into(),
                );
            }
        }
        if step + 1 == plan.steps {
            break;
        }
        // Every consumer released the first tensor: hand it to one of them to update.
        let first = weights.remove(0);
        let first = back(first.reclaim())?;
        let lent = importers[step % plan.consumers]
            .lend(engine, first)
            .map_err(|e| e.to_string())?;
        let first = back(lent)?;
        let host = download_tensor(engine, &first)?;
        if host.iter().any(|&x| x != value(0, step + 1)) {
            return Err(format!("the hand-off at step {step} did not double the tensor").into());
        }
        weights.insert(0, engine.export_tensor(first).map_err(|e| e.to_string())?);
    }
    Ok(())
}

/// The tensor of a loan or a reclaim, once its importers have handed it back or released it,
/// within [`DEADLINE`].
fn back<Op>(pending: Pending<Op>) -> Result<DeviceTensor<f32>, BoxError>
where
    Op: Operation<Parts = DeviceTensor<f32>>,
{
    match pending.wait_for(DEADLINE)? {
        TryWait::Returned(back) => Ok(back.into_parts()),
        TryWait::InFlight(op) => Err(format!("{op:?}: not back within {DEADLINE:?}").into()),
    }
}

fn options() -> Result<(Plan, bool), BoxError> {
    let mut plan = Plan {
        consumers: 2,
        steps: 3,
        elements: ELEMENTS,
    };
    let mut simulated = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<usize, BoxError> {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            Ok(v.parse().map_err(|e| format!("{name} {v:?}: {e}"))?)
        };
        match arg.as_str() {
            "--consumers" => plan.consumers = value("--consumers")?.max(1),
            "--steps" => plan.steps = value("--steps")?.max(1),
            "--simulated" => simulated = true,
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    Ok((plan, simulated))
}

/// A socket path of this process's own.
fn socket_path() -> PathBuf {
    std::env::temp_dir().join(format!(
        "cuferry-shared-weights-{}.sock",
        std::process::id()
    ))
}

/// A consumer process: `CUFERRY_SHARE_SOCKET` names the producer's socket, and
/// `CUFERRY_CONSUMER` is `index/consumers/steps/elements`.
fn consumer_process(socket: &Path, spec: &str) -> Result<(), BoxError> {
    let field: Vec<usize> = spec.split('/').map(str::parse).collect::<Result<_, _>>()?;
    let [me, consumers, steps, elements] = field[..] else {
        return Err(format!("CUFERRY_CONSUMER={spec:?}").into());
    };
    let plan = Plan {
        consumers,
        steps,
        elements,
    };
    let mut engine = CudaEngine::open(0)?;
    let mut link = ShareLink::connect(&mut engine, socket)?;
    consumer(&mut engine, &mut link, me, plan, &mut |line| {
        println!("{line}")
    })
}

/// The producer with consumer processes.
fn run_processes(plan: Plan) -> Result<(), BoxError> {
    let mut engine = CudaEngine::open(0)?;
    let path = socket_path();
    let listener = ShareListener::bind(&path)?;
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    let mut importers = Vec::new();
    let mut lines = Vec::new();
    for k in 0..plan.consumers {
        let mut child = Command::new(&exe)
            .env("CUFERRY_SHARE_SOCKET", &path)
            .env(
                "CUFERRY_CONSUMER",
                format!("{k}/{}/{}/{}", plan.consumers, plan.steps, plan.elements),
            )
            .stdout(Stdio::piped())
            .spawn()?;
        lines.push(BufReader::new(child.stdout.take().expect("piped")).lines());
        children.push(child);
        // Consumers connect in the order they were started: each is accepted before the next
        // starts.
        importers.push(listener.accept(&mut engine)?);
    }
    let outcome = producer(&mut engine, &importers, plan, &mut |k| {
        Ok(lines[k].next().ok_or("the consumer exited early")??)
    });
    for (k, mut child) in children.into_iter().enumerate() {
        let status = child.wait()?;
        if !status.success() && outcome.is_ok() {
            return Err(format!("consumer {k} exited with {status}").into());
        }
    }
    outcome
}

/// The producer with consumer threads on a simulated machine (feature `sim`).
#[cfg(feature = "sim")]
pub(crate) fn run_simulated(plan: Plan) -> Result<(), BoxError> {
    use cuferry::sim::{SimConfig, SimDevice};
    use std::sync::mpsc;
    let machine = SimDevice::new(SimConfig::default());
    let mut engine = CudaEngine::simulated_on(&machine);
    let path = socket_path().with_extension(format!("sim{}.sock", rand_suffix()));
    let listener = ShareListener::bind(&path)?;
    let mut threads = Vec::new();
    let mut importers = Vec::new();
    let mut reports = Vec::new();
    for k in 0..plan.consumers {
        let (tx, rx) = mpsc::channel::<String>();
        reports.push(rx);
        let (machine, path) = (machine.clone(), path.clone());
        threads.push(std::thread::spawn(move || -> Result<(), BoxError> {
            let mut engine = CudaEngine::simulated_on(&machine);
            let mut link = ShareLink::connect(&mut engine, &path)?;
            consumer(&mut engine, &mut link, k, plan, &mut |line| {
                let _ = tx.send(line);
            })
        }));
        importers.push(listener.accept(&mut engine)?);
    }
    let outcome = producer(&mut engine, &importers, plan, &mut |k| {
        Ok(reports[k].recv_timeout(DEADLINE)?)
    });
    for (k, thread) in threads.into_iter().enumerate() {
        let result = thread
            .join()
            .map_err(|_| format!("consumer {k} panicked"))?;
        if let Err(error) = result
            && outcome.is_ok()
        {
            return Err(format!("consumer {k}: {error}").into());
        }
    }
    if let Some(violation) = machine.violations().first() {
        return Err(format!("the simulated device saw {violation:?}").into());
    }
    outcome
}

/// A number to keep concurrent runs' socket paths apart.
#[cfg(feature = "sim")]
fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn main() -> ExitCode {
    if let (Some(socket), Ok(spec)) = (
        std::env::var_os("CUFERRY_SHARE_SOCKET"),
        std::env::var("CUFERRY_CONSUMER"),
    ) {
        return match consumer_process(Path::new(&socket), &spec) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("consumer: {error}");
                ExitCode::FAILURE
            }
        };
    }
    let start = Instant::now();
    let outcome = options().and_then(|(plan, simulated)| {
        if simulated {
            #[cfg(feature = "sim")]
            return run_simulated(plan).map(|()| plan);
            #[cfg(not(feature = "sim"))]
            return Err("--simulated needs the `sim` feature: cargo run --example shared_weights --features sim -- --simulated".into());
        }
        if CudaEngine::device_count().unwrap_or(0) == 0 {
            return Err("no GPU (run with --simulated and the `sim` feature to try it without)".into());
        }
        run_processes(plan).map(|()| plan)
    });
    match outcome {
        Ok(plan) => {
            println!(
                "{} consumers, {} steps of {TENSORS} tensors of {} MiB shared read-only, {} exclusive hand-offs: every checksum right, in {:.1?}",
                plan.consumers,
                plan.steps,
                (plan.elements * 4) >> 20,
                plan.steps - 1,
                start.elapsed()
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("shared_weights: {error}");
            ExitCode::FAILURE
        }
    }
}
