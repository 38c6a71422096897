//! Collectives across processes, launched as `torchrun --nproc-per-node N` launches them.
//!
//! ```text
//! cargo run --release --example multi_process                  # one rank per GPU
//! cargo run --release --example multi_process -- --nproc 2     # two ranks (two GPUs)
//! cargo run --example multi_process --features sim -- --simulated --nproc 3
//! ```
//!
//! Without `RANK` in its environment the program is the launcher: it starts `--nproc` copies of
//! itself (default: one per GPU) with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
//! `MASTER_PORT` set, and waits for them. With `RANK` set it is a rank: it opens GPU
//! `LOCAL_RANK`, meets rank 0 at the TCP rendezvous for NCCL's unique id, joins the
//! communicator, and runs an all-reduce, an all-gather and a ring of sends and receives,
//! checking every result. The launcher exits 0 when every rank did; when one fails, it stops the
//! others (as `torchrun` does) and exits 1 with that rank's error, which the rank printed.
//!
//! `--simulated` (feature `sim`) runs the ranks on a simulated machine with a device per rank.
//! A simulated machine lives in one process, so there the launcher runs each rank on a thread of
//! its own, with the launcher variables a process would get, through the same rendezvous and
//! join. `--fail-rank K` makes rank `K` fail after the all-reduce, before the all-gather, to show
//! what a dead peer does: the others end by their deadline (`--timeout`, in seconds, default
//! 60) with a typed error.

use cuferry::collective::{Communicator, DEFAULT_BOOTSTRAP_TIMEOUT, Launch, ReduceOp, UniqueId};
use cuferry::{CudaEngine, download_tensor, upload_tensor};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Elements each rank contributes (4 MiB of `f32`).
const ELEMENTS: usize = 1 << 20;

/// What the launcher was asked.
struct Options {
    nproc: Option<usize>,
    simulated: bool,
    timeout: Duration,
    fail_rank: Option<usize>,
}

fn options() -> Result<Options, BoxError> {
    let mut options = Options {
        nproc: None,
        simulated: false,
        timeout: Duration::from_secs(60),
        fail_rank: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<usize, BoxError> {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            Ok(v.parse().map_err(|e| format!("{name} {v:?}: {e}"))?)
        };
        match arg.as_str() {
            "--nproc" => options.nproc = Some(value("--nproc")?),
            "--simulated" => options.simulated = true,
            "--timeout" => options.timeout = Duration::from_secs(value("--timeout")? as u64),
            "--fail-rank" => options.fail_rank = Some(value("--fail-rank")?),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    Ok(options)
}

/// What one rank saw.
pub(crate) struct Report {
    pub rank: usize,
    pub world: usize,
    pub elapsed: Duration,
}

/// Rank `launch.rank`'s part of the job, on `engine`: the rendezvous, the join, and the three
/// collectives, each result checked. Rank `fail` (if any) fails on purpose after the first.
pub(crate) fn rank(
    launch: &Launch,
    engine: &mut CudaEngine,
    n: usize,
    timeout: Duration,
    fail: Option<usize>,
) -> Result<Report, BoxError> {
    let started = Instant::now();
    let (me, world) = (launch.rank, launch.world);
    // One deadline for the job: the rendezvous, the join and every collective inherit it.
    let launch = launch.clone().with_timeout(timeout);
    let id = launch.rendezvous()?.exchange(|| UniqueId::new(engine))?;
    let comm = launch.join(engine, &id)?;

    // All-reduce: rank r contributes r + 1 everywhere, so every element sums to w(w+1)/2.
    let mine = upload_tensor(engine, &vec![(me + 1) as f32; n], &[n])?;
    let summed = comm
        .group()
        .all_reduce(vec![mine], ReduceOp::Sum)
        .submit(&mut [&mut *engine])?
        .wait()?
        .into_parts();
    let want = (world * (world + 1) / 2) as f32;
    if let Some(bad) = download_tensor(engine, &summed[0])?
        .iter()
        .position(|&x| x != want)
    {
        return Err(format!("all-reduce: element {bad} is not {want}").into());
    }
    if fail == Some(me) {
        return Err(format!("rank {me} fails here, as --fail-rank asked").into());
    }

    // All-gather: rank r's slice holds r * n + i, so the gathered tensor counts 0, 1, 2, ...
    let slice: Vec<f32> = (0..n).map(|i| (me * n + i) as f32).collect();
    let input = upload_tensor(engine, &slice, &[n])?;
    let output = upload_tensor(engine, &vec![-1.0f32; world * n], &[world * n])?;
    let gathered = comm
        .group()
        .all_gather(vec![input], vec![output])
        .submit(&mut [&mut *engine])?
        .wait()?
        .into_parts();
    let got = download_tensor(engine, &gathered[1])?;
    if let Some(bad) = (0..world * n).find(|&i| got[i] != i as f32) {
        return Err(format!("all-gather: element {bad} is {}", got[bad]).into());
    }

    // A ring: each rank sends its slice to the next and receives the previous rank's, in one
    // group (a send and a receive outside one group could wait for each other for ever).
    let (next, previous) = ((me + 1) % world, (me + world - 1) % world);
    let theirs = upload_tensor(engine, &vec![-1.0f32; n], &[n])?;
    let ring = comm
        .group()
        .send(0, gathered.into_iter().next().expect("the input"), next)
        .recv(previous, 0, theirs);
    let parts = ring.submit(&mut [&mut *engine])?.wait()?.into_parts();
    let got = download_tensor(engine, &parts[1])?;
    if let Some(bad) = (0..n).find(|&i| got[i] != (previous * n + i) as f32) {
        return Err(format!("ring: element {bad} is not rank {previous}'s").into());
    }
    engine.synchronize()?;
    Ok(Report {
        rank: me,
        world,
        elapsed: started.elapsed(),
    })
}

/// A rank, in a process the launcher started: the launcher's variables, GPU `LOCAL_RANK`.
fn rank_process() -> ExitCode {
    let run = || -> Result<Report, BoxError> {
        let launch = Launch::from_env()?;
        let timeout = std::env::var("CUFERRY_EXAMPLE_TIMEOUT")
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(Duration::from_secs(60), Duration::from_secs);
        let fail = std::env::var("CUFERRY_EXAMPLE_FAIL_RANK")
            .ok()
            .and_then(|s| s.parse().ok());
        let mut engine = CudaEngine::open(launch.local_rank)?;
        rank(&launch, &mut engine, ELEMENTS, timeout, fail)
    };
    let who = std::env::var("RANK").unwrap_or_default();
    match run() {
        Ok(r) => {
            println!(
                "rank {} of {}: all-reduce, all-gather and ring checked in {:.1?}",
                r.rank, r.world, r.elapsed
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rank {who}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A port on the loopback interface that no one listens on now.
fn free_port() -> Result<u16, BoxError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The launcher's variables of `rank` in a world of `world`, rendezvous at `port`.
fn variables(rank: usize, world: usize, port: u16) -> [(&'static str, String); 5] {
    [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_owned()),
        ("MASTER_PORT", port.to_string()),
    ]
}

/// Starts `world` copies of this program, one per rank, and waits for them: `Err` names the
/// first rank that failed (the others are stopped).
fn launch_processes(world: usize, options: &Options) -> Result<(), BoxError> {
    let port = free_port()?;
    let me = std::env::current_exe()?;
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(world);
    for rank in 0..world {
        let mut command = Command::new(&me);
        command.envs(variables(rank, world, port)).env(
            "CUFERRY_EXAMPLE_TIMEOUT",
            options.timeout.as_secs().to_string(),
        );
        if let Some(fail) = options.fail_rank {
            command.env("CUFERRY_EXAMPLE_FAIL_RANK", fail.to_string());
        }
        children.push((rank, command.spawn()?));
    }
    let mut failed = None;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait()? {
                None => i += 1,
                Some(status) => {
                    let (rank, _) = children.swap_remove(i);
                    if !status.success() && failed.is_none() {
                        failed = Some(format!("rank {rank} failed ({status})"));
                        // As torchrun does: one rank's failure ends the job.
                        for (_, child) in &mut children {
                            let _ = child.kill();
                        }
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    failed.map_or(Ok(()), |f| Err(f.into()))
}

/// Runs `world` ranks on a simulated machine of `world` devices, one thread each, with the
/// variables a launched process would get: each rank's outcome, in rank order.
#[cfg(feature = "sim")]
pub(crate) fn launch_simulated(
    world: usize,
    n: usize,
    timeout: Duration,
    fail: Option<usize>,
) -> Result<Vec<Result<Report, BoxError>>, BoxError> {
    use cuferry::sim::{SimConfig, SimDevice};
    let machine = SimDevice::new(SimConfig {
        devices: world,
        ..SimConfig::default()
    });
    let port = free_port()?;
    Ok(std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let machine = machine.clone();
                s.spawn(move || -> Result<Report, BoxError> {
                    let vars = variables(rank, world, port);
                    let launch = Launch::from_vars(|name| {
                        vars.iter()
                            .find(|(k, _)| *k == name)
                            .map(|(_, v)| v.clone())
                    })?;
                    let mut engine = CudaEngine::simulated_on_device(&machine, launch.local_rank)?;
                    self::rank(&launch, &mut engine, n, timeout, fail)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().unwrap_or_else(|_| Err("the rank panicked".into())))
            .collect()
    }))
}

fn launcher() -> Result<(), BoxError> {
    let options = options()?;
    if options.simulated {
        #[cfg(feature = "sim")]
        {
            let world = options.nproc.unwrap_or(2);
            println!("{world} ranks on a simulated machine, one thread each (--simulated)");
            let outcomes = launch_simulated(world, 4096, options.timeout, options.fail_rank)?;
            // The rank whose failure is its own, not a peer's deadline passed because of it.
            let mut failed: Option<(bool, String)> = None;
            for (rank, outcome) in outcomes.into_iter().enumerate() {
                match outcome {
                    Ok(r) => println!(
                        "rank {rank} of {world}: all-reduce, all-gather and ring checked in {:.1?}",
                        r.elapsed
                    ),
                    Err(e) => {
                        eprintln!("rank {rank}: error: {e}");
                        let own = !matches!(
                            e.downcast_ref::<cuferry::Error>(),
                            Some(cuferry::Error::Peer(_))
                        );
                        if failed
                            .as_ref()
                            .is_none_or(|(first_own, _)| own && !first_own)
                        {
                            failed = Some((own, format!("rank {rank} failed: {e}")));
                        }
                    }
                }
            }
            return failed.map_or(Ok(()), |(_, f)| Err(f.into()));
        }
        #[cfg(not(feature = "sim"))]
        return Err("--simulated needs the `sim` feature: cargo run --example multi_process --features sim -- --simulated".into());
    }
    let world = match options.nproc {
        Some(n) => n,
        None => CudaEngine::device_count()?,
    };
    if world == 0 {
        return Err("no GPU (run with --simulated and the `sim` feature to try it without)".into());
    }
    println!(
        "launching {world} rank(s), NCCL {:?}, rendezvous on loopback (default timeout {:?})",
        Communicator::nccl_version()?,
        DEFAULT_BOOTSTRAP_TIMEOUT.min(options.timeout)
    );
    launch_processes(world, &options)?;
    println!("every rank checked its results");
    Ok(())
}

fn main() -> ExitCode {
    if std::env::var_os("RANK").is_some() {
        return rank_process();
    }
    match launcher() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
