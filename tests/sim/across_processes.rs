//! Collectives across ranks that join one by one, as processes of their own do: one thread per
//! rank on one simulated machine, each bootstrapped as a launched process is (the launcher's
//! variables, the TCP rendezvous on loopback, `Communicator::join`). Every collective against a
//! reference; a rank that never queues its part, one that stops in the middle of a collective,
//! and wrong lengths on one rank, each ending every rank's wait by its deadline with a typed
//! error, nothing freed under queued work and every engine usable after; and a fault at every
//! step of a rank's collective.

use cuferry::collective::{Communicator, Launch, ReduceOp, UniqueId};
use cuferry::error::{DriverError, PeerError, UsageError};
use cuferry::pending::TryWait;
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{CudaEngine, DeviceTensor, Error, SubmitError, download_tensor, upload_tensor};
use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// A barrier that gives up (panics) after a minute: a rank that panicked before reaching it
/// fails the test instead of hanging it.
struct Barrier {
    parties: usize,
    arrived: Mutex<(usize, u64)>,
    all: Condvar,
}

impl Barrier {
    fn new(parties: usize) -> Barrier {
        Barrier {
            parties,
            arrived: Mutex::new((0, 0)),
            all: Condvar::new(),
        }
    }

    fn wait(&self) {
        let mut state = self.arrived.lock().unwrap();
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.parties {
            *state = (0, generation + 1);
            self.all.notify_all();
            return;
        }
        let (state, timeout) = self
            .all
            .wait_timeout_while(state, Duration::from_secs(60), |s| s.1 == generation)
            .unwrap();
        assert!(!timeout.timed_out(), "a rank never reached the barrier");
        drop(state);
    }
}

/// A loopback port no one listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn machine(devices: usize) -> SimDevice {
    SimDevice::new(SimConfig {
        devices,
        ..SimConfig::default()
    })
}

/// Runs `body` on `world` ranks, one thread each, as launched processes: each reads its
/// launcher variables, opens its engine on device `LOCAL_RANK` of `sim`, meets rank 0 at the
/// rendezvous for the id and joins. Returns each rank's result, in rank order.
fn ranks<R: Send>(
    sim: &SimDevice,
    world: usize,
    body: impl Fn(usize, &mut CudaEngine, Communicator) -> R + Sync,
) -> Vec<R> {
    let port = free_port();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let body = &body;
                s.spawn(move || {
                    let vars: HashMap<&str, String> = HashMap::from([
                        ("RANK", rank.to_string()),
                        ("WORLD_SIZE", world.to_string()),
                        ("LOCAL_RANK", rank.to_string()),
                        ("MASTER_ADDR", "127.0.0.1".to_owned()),
                        ("MASTER_PORT", port.to_string()),
                    ]);
                    let launch = Launch::from_vars(|v| vars.get(v).cloned()).unwrap();
                    let mut engine =
                        CudaEngine::simulated_on_device(sim, launch.local_rank).unwrap();
                    let id = launch
                        .rendezvous()
                        .unwrap()
                        .exchange(|| UniqueId::new(&engine))
                        .unwrap();
                    let comm =
                        Communicator::join(&mut engine, &id, launch.rank, launch.world).unwrap();
                    body(launch.rank, &mut engine, comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn up(engine: &mut CudaEngine, v: &[i64]) -> DeviceTensor<i64> {
    upload_tensor(engine, v, &[v.len()]).unwrap()
}

fn down(engine: &mut CudaEngine, t: &DeviceTensor<i64>) -> Vec<i64> {
    download_tensor(engine, t).unwrap()
}

/// Rank `rank`'s values: `len` of them, distinct across ranks and calls.
fn values(rank: usize, len: usize, call: i64) -> Vec<i64> {
    (0..len as i64)
        .map(|i| (rank as i64 + 1) * 1000 + i * (call + 1))
        .collect()
}

/// What one rank's collectives gave, in the order run.
type Results = Vec<Vec<i64>>;

#[test]
fn every_collective_runs_across_ranks_that_joined_one_by_one() {
    let world = 3;
    let n = 4;
    let sim = machine(world);
    let results: Vec<Results> = ranks(&sim, world, |rank, engine, comm| {
        assert_eq!((comm.rank(), comm.world(), comm.ranks()), (rank, world, 1));
        let mut got = Vec::new();
        // Waits for a collective and downloads its last tensor (the output).
        macro_rules! run {
            ($submitted:expr) => {{
                let submitted = $submitted;
                let parts = submitted.unwrap().wait().unwrap().into_parts();
                got.push(down(engine, parts.last().unwrap()));
            }};
        }
        let t = up(engine, &values(rank, n, 0));
        run!(
            comm.group()
                .all_reduce(vec![t], ReduceOp::Sum)
                .submit(&mut [&mut *engine])
        );
        let t = up(engine, &values(rank, n, 1));
        run!(
            comm.group()
                .broadcast(vec![t], 1)
                .submit(&mut [&mut *engine])
        );
        let t = up(engine, &values(rank, n, 2));
        run!(
            comm.group()
                .reduce(vec![t], ReduceOp::Min, 2)
                .submit(&mut [&mut *engine])
        );
        let (i, o) = (
            up(engine, &values(rank, n, 3)),
            up(engine, &vec![0; world * n]),
        );
        run!(
            comm.group()
                .all_gather(vec![i], vec![o])
                .submit(&mut [&mut *engine])
        );
        let (i, o) = (
            up(engine, &values(rank, world * n, 4)),
            up(engine, &vec![0; n]),
        );
        run!(
            comm.group()
                .reduce_scatter(vec![i], vec![o], ReduceOp::Max)
                .submit(&mut [&mut *engine])
        );
        // A ring, grouped: each rank sends to the next and receives the previous one's.
        let (mine, theirs) = (up(engine, &values(rank, n, 5)), up(engine, &vec![0; n]));
        let ring = comm.group().send(0, mine, (rank + 1) % world).recv(
            (rank + world - 1) % world,
            0,
            theirs,
        );
        run!(ring.submit(&mut [&mut *engine]));
        // A send alone, from rank 0 to rank 2; rank 1 takes no part.
        match rank {
            0 => {
                let t = up(engine, &values(0, n, 6));
                drop(
                    comm.group()
                        .send(0, t, 2)
                        .submit(&mut [&mut *engine])
                        .unwrap()
                        .wait()
                        .unwrap(),
                );
            }
            2 => {
                let t = up(engine, &vec![0; n]);
                run!(comm.group().recv(0, 0, t).submit(&mut [&mut *engine]));
            }
            _ => {}
        }
        // Awaited, on a runtime-free executor.
        let t = up(engine, &values(rank, n, 7));
        let pending = comm
            .group()
            .all_reduce(vec![t], ReduceOp::Max)
            .submit(&mut [&mut *engine])
            .unwrap();
        let parts = futures_lite::future::block_on(pending.into_future())
            .unwrap()
            .into_parts();
        got.push(down(engine, &parts[0]));
        engine.synchronize().unwrap();
        got
    });
    let all = |call| (0..world).map(|r| values(r, n, call)).collect::<Vec<_>>();
    let fold = |call, f: fn(i64, i64) -> i64| -> Vec<i64> {
        let v = all(call);
        (0..n)
            .map(|i| v.iter().map(|x| x[i]).reduce(f).unwrap())
            .collect()
    };
    for (rank, got) in results.iter().enumerate() {
        assert_eq!(got[0], fold(0, |a, b| a + b), "rank {rank}'s all-reduce");
        assert_eq!(
            got[1],
            values(1, n, 1),
            "rank {rank}'s broadcast from rank 1"
        );
        let reduced = if rank == 2 {
            fold(2, i64::min)
        } else {
            values(rank, n, 2)
        };
        assert_eq!(got[2], reduced, "rank {rank}'s reduce into rank 2");
        assert_eq!(got[3], all(3).concat(), "rank {rank}'s all-gather");
        let full: Vec<i64> = (0..world * n)
            .map(|i| {
                (0..world)
                    .map(|r| values(r, world * n, 4)[i])
                    .max()
                    .unwrap()
            })
            .collect();
        assert_eq!(
            got[4],
            full[rank * n..(rank + 1) * n],
            "rank {rank}'s reduce-scatter"
        );
        assert_eq!(
            got[5],
            values((rank + world - 1) % world, n, 5),
            "rank {rank}'s ring"
        );
        let last = if rank == 2 {
            assert_eq!(got[6], values(0, n, 6), "rank 2's receive from rank 0");
            7
        } else {
            6
        };
        assert_eq!(
            got[last],
            fold(7, i64::max),
            "rank {rank}'s awaited all-reduce"
        );
        assert_eq!(got.len(), last + 1);
    }
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0, "every tensor released");
}

/// Whether `error` is rank `rank`'s deadline passed in a world of `world`.
fn timed_out(error: &Error, rank: usize, world: usize) -> bool {
    matches!(error, Error::Peer(PeerError::CollectiveTimedOut { rank: r, world: w, .. })
        if (*r, *w) == (rank, world))
}

/// After a collective ended by the abort: the engine works, a later collective on the
/// communicator is refused with its tensor back, and the aborted one's tensors are released
/// once the engine proves their parts ended.
fn works_on_after_the_abort(engine: &mut CudaEngine, comm: &Communicator) {
    let t = up(engine, &[1, 2, 3]);
    assert_eq!(down(engine, &t), [1, 2, 3]);
    match comm
        .group()
        .all_reduce(vec![t], ReduceOp::Sum)
        .submit(&mut [&mut *engine])
    {
        Err(SubmitError::Failed {
            input,
            error: Error::Peer(PeerError::Aborted { .. }),
        }) => assert_eq!(down(engine, &input[0]), [1, 2, 3]),
        other => panic!("{other:?}"),
    }
    engine.synchronize().unwrap();
    let stats = engine.retirement_stats();
    assert_eq!((stats.pending, stats.retained), (0, 0), "{stats:?}");
}

#[test]
fn a_rank_that_never_queues_its_part_fails_its_peers_by_their_deadline() {
    let world = 3;
    let sim = machine(world);
    let deadline = Duration::from_millis(300);
    let done = Barrier::new(world);
    ranks(&sim, world, |rank, engine, comm| {
        let comm = comm.with_timeout(deadline);
        assert_eq!(comm.timeout(), deadline);
        if rank == 2 {
            // Alive, joined, and never taking part: the others must not hang on it.
            done.wait();
            return;
        }
        let t = up(engine, &values(rank, 64, 0));
        let started = Instant::now();
        let pending = comm
            .group()
            .all_reduce(vec![t], ReduceOp::Sum)
            .submit(&mut [&mut *engine])
            .unwrap();
        let error = pending.wait().unwrap_err();
        assert!(timed_out(&error, rank, world), "{error:?}");
        let waited = started.elapsed();
        assert!(waited >= deadline && waited < deadline * 20, "{waited:?}");
        works_on_after_the_abort(engine, &comm);
        done.wait();
    });
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0, "every tensor released");
}

#[test]
fn a_rank_that_stops_in_the_middle_of_a_collective_fails_its_peers_by_their_deadline() {
    let world = 3;
    let sim = machine(world);
    let deadline = Duration::from_millis(300);
    let done = Barrier::new(world);
    let gone = Barrier::new(world);
    ranks(&sim, world, |rank, engine, comm| {
        let comm = comm.with_timeout(deadline);
        // One collective together.
        let t = up(engine, &values(rank, 16, 0));
        let summed = comm
            .group()
            .all_reduce(vec![t], ReduceOp::Sum)
            .submit(&mut [&mut *engine])
            .unwrap()
            .wait()
            .unwrap();
        // In the next, rank 2 queues its part and dies: its communicator is aborted (its
        // kernels end), and only then do the others queue theirs and wait.
        if rank != 2 {
            gone.wait();
        }
        let next = summed.resubmit(&mut [&mut *engine]).unwrap();
        let error = match rank {
            2 => {
                comm.abort();
                comm.abort(); // a second abort does nothing
                gone.wait();
                next.wait().unwrap_err()
            }
            // Awaited, woken by the timer to watch the communicator.
            1 => futures_lite::future::block_on(next.into_future()).unwrap_err(),
            // Asked without waiting until it answers.
            _ => {
                let mut next = next;
                loop {
                    match next.try_wait() {
                        Ok(TryWait::InFlight(pending)) => next = pending,
                        Ok(TryWait::Returned(returned)) => {
                            panic!("completed without rank 2: {returned:?}")
                        }
                        Err(error) => break error,
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        if rank == 2 {
            assert!(
                matches!(error, Error::Peer(PeerError::Aborted { rank: 2, world: 3 })),
                "{error:?}"
            );
        } else {
            assert!(timed_out(&error, rank, world), "{error:?}");
        }
        works_on_after_the_abort(engine, &comm);
        done.wait();
    });
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0, "every tensor released");
}

#[test]
fn wrong_lengths_on_one_rank_are_refused_there_and_its_peers_end_by_their_deadline() {
    let world = 3;
    let sim = machine(world);
    let deadline = Duration::from_millis(300);
    let done = Barrier::new(world);
    ranks(&sim, world, |rank, engine, comm| {
        let comm = comm.with_timeout(deadline);
        let n = 8;
        // Rank 1's output is one element short: NCCL would write past it.
        let out = if rank == 1 { world * n - 1 } else { world * n };
        let (i, o) = (up(engine, &values(rank, n, 0)), up(engine, &vec![0; out]));
        match comm
            .group()
            .all_gather(vec![i], vec![o])
            .submit(&mut [&mut *engine])
        {
            Err(SubmitError::Rejected { input, error }) => {
                assert_eq!(rank, 1);
                assert!(
                    matches!(error, Error::Usage(UsageError::LengthMismatch { expected: 23, found: 23, .. }) if false)
                        || matches!(
                            error,
                            Error::Usage(UsageError::LengthMismatch {
                                expected: 24,
                                found: 23,
                                ..
                            })
                        ),
                    "{error:?}"
                );
                assert_eq!(
                    down(engine, &input[0]),
                    values(1, n, 0),
                    "handed back untouched"
                );
            }
            Ok(pending) => {
                assert_ne!(rank, 1);
                let error = pending.wait().unwrap_err();
                assert!(timed_out(&error, rank, world), "{error:?}");
                works_on_after_the_abort(engine, &comm);
            }
            Err(other) => panic!("{other:?}"),
        }
        done.wait();
    });
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0, "every tensor released");
}

#[test]
fn counts_that_differ_across_ranks_fail_every_rank_and_touch_nothing() {
    let world = 2;
    let sim = machine(world);
    ranks(&sim, world, |rank, engine, comm| {
        let comm = comm.with_timeout(Duration::from_secs(30));
        // Rank 1 reduces three elements where rank 0 reduces four: NCCL does not check (its
        // ranks hang or corrupt); the simulated kernels end with an error.
        let t = up(engine, &values(rank, 4 - rank, 0));
        let error = comm
            .group()
            .all_reduce(vec![t], ReduceOp::Sum)
            .submit(&mut [&mut *engine])
            .unwrap()
            .wait()
            .unwrap_err();
        assert!(
            matches!(
                error,
                Error::DeviceFault {
                    what: "collective",
                    source: DriverError::LAUNCH_FAILED
                }
            ),
            "{error:?}"
        );
        let _ = engine.synchronize();
    });
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// The last tensor of a collective once it has completed.
fn last(submitted: cuferry::collective::Submitted<i64>) -> Result<DeviceTensor<i64>, Error> {
    let pending = submitted.map_err(SubmitError::into_error)?;
    Ok(pending.wait()?.into_parts().pop().expect("a tensor"))
}

/// Rank `rank` of a world of two runs every collective once, alone or grouped, and checks each
/// result; the first failure ends it.
fn every_collective(
    comm: &Communicator,
    engine: &mut CudaEngine,
    rank: usize,
) -> Result<(), Error> {
    let (n, peer) = (8, 1 - rank);
    let upload = |engine: &mut CudaEngine, v: &[i64]| upload_tensor(engine, v, &[v.len()]);
    let pair = |call, f: fn(i64, i64) -> i64| -> Vec<i64> {
        (0..n)
            .map(|i| f(values(0, n, call)[i], values(1, n, call)[i]))
            .collect()
    };
    let check = |engine: &mut CudaEngine, t: DeviceTensor<i64>, want: Vec<i64>, what| {
        download_tensor(engine, &t).map(|got| assert_eq!(got, want, "rank {rank}: {what}"))
    };
    let t = upload(engine, &values(rank, n, 0))?;
    let out = last(
        comm.group()
            .all_reduce(vec![t], ReduceOp::Sum)
            .submit(&mut [&mut *engine]),
    )?;
    check(engine, out, pair(0, |a, b| a + b), "all-reduce")?;
    let t = upload(engine, &values(rank, n, 1))?;
    let out = last(
        comm.group()
            .broadcast(vec![t], 1)
            .submit(&mut [&mut *engine]),
    )?;
    check(engine, out, values(1, n, 1), "broadcast")?;
    let t = upload(engine, &values(rank, n, 2))?;
    let out = last(
        comm.group()
            .reduce(vec![t], ReduceOp::Max, 0)
            .submit(&mut [&mut *engine]),
    )?;
    let want = if rank == 0 {
        pair(2, i64::max)
    } else {
        values(1, n, 2)
    };
    check(engine, out, want, "reduce")?;
    let (i, o) = (
        upload(engine, &values(rank, n, 3))?,
        upload(engine, &[0; 16])?,
    );
    let out = last(
        comm.group()
            .all_gather(vec![i], vec![o])
            .submit(&mut [&mut *engine]),
    )?;
    check(
        engine,
        out,
        [values(0, n, 3), values(1, n, 3)].concat(),
        "all-gather",
    )?;
    let (i, o) = (
        upload(engine, &values(rank, 2 * n, 4))?,
        upload(engine, &[0; 8])?,
    );
    let out = last(
        comm.group()
            .reduce_scatter(vec![i], vec![o], ReduceOp::Sum)
            .submit(&mut [&mut *engine]),
    )?;
    let want = (rank * n..(rank + 1) * n)
        .map(|i| values(0, 2 * n, 4)[i] + values(1, 2 * n, 4)[i])
        .collect();
    check(engine, out, want, "reduce-scatter")?;
    let (mine, theirs) = (
        upload(engine, &values(rank, n, 5))?,
        upload(engine, &[0; 8])?,
    );
    let ring = comm.group().send(0, mine, peer).recv(peer, 0, theirs);
    let out = last(ring.submit(&mut [&mut *engine]))?;
    check(engine, out, values(peer, n, 5), "grouped exchange")?;
    if rank == 0 {
        let t = upload(engine, &values(0, n, 6))?;
        last(comm.group().send(0, t, 1).submit(&mut [&mut *engine]))?;
    } else {
        let t = upload(engine, &[0; 8])?;
        let out = last(comm.group().recv(0, 0, t).submit(&mut [&mut *engine]))?;
        check(engine, out, values(0, n, 6), "receive")?;
    }
    Ok(())
}

/// Every collective once on each rank of two, the fault armed by rank 0 once both have
/// joined: each rank's outcome, `Ok` with every result right or a typed error by its
/// deadline.
fn faulted_world(op: SimOp, n: u64) -> (SimDevice, Vec<Result<(), Error>>, u64) {
    let world = 2;
    let sim = machine(world);
    let joined = Barrier::new(world);
    let armed_at = std::sync::atomic::AtomicU64::new(0);
    let outcomes = ranks(&sim, world, |rank, engine, comm| {
        let comm = comm.with_timeout(Duration::from_millis(200));
        engine.synchronize().unwrap();
        joined.wait();
        if rank == 0 {
            armed_at.store(sim.calls(op), std::sync::atomic::Ordering::Relaxed);
            if n > 0 {
                sim.fail_nth(op, n, DriverError::UNKNOWN);
            }
        }
        joined.wait();
        let mut steps = || -> Result<(), Error> {
            every_collective(&comm, engine, rank)?;
            Ok(())
        };
        // A failure found later is reported at the next boundary.
        let outcome = steps().and_then(|()| engine.synchronize());
        // Whatever happened, this rank's communicator is done with: its parts end.
        comm.abort();
        let _ = engine.synchronize();
        outcome
    });
    let after = sim.calls(op) - armed_at.into_inner();
    (sim, outcomes, after)
}

#[test]
fn a_fault_at_every_step_of_every_collective_ends_every_rank_with_a_typed_error() {
    let steps = [
        SimOp::GroupStart,
        SimOp::Collective,
        SimOp::GroupEnd,
        SimOp::EventRecord,
        SimOp::EventSynchronize,
        SimOp::CommHealth,
    ];
    let started = Instant::now();
    let (mut failures, mut points) = (0, 0);
    for op in steps {
        // The calls of a clean run, once both ranks have joined.
        let (_, outcomes, calls) = faulted_world(op, 0);
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        assert!(calls > 0, "{op:?} is a step of the route");
        for n in 1..=calls {
            let (sim, outcomes, reached) = faulted_world(op, n);
            if reached < n {
                // A watch's extra health query (one per slice a wait outlasts) is a step of
                // that schedule only: this one made fewer, so the fault never fired.
                assert!(
                    outcomes.iter().all(Result::is_ok),
                    "{op:?} #{n}: {outcomes:?}"
                );
                continue;
            }
            points += 1;
            assert!(
                outcomes.iter().any(Result::is_err),
                "{op:?} #{n}: the fault was reported"
            );
            for outcome in &outcomes {
                match outcome {
                    Ok(()) => {}
                    Err(
                        Error::Peer(_)
                        | Error::Library(_)
                        | Error::DeviceFault { .. }
                        | Error::Driver { .. }
                        | Error::Deferred { .. },
                    ) => failures += 1,
                    Err(other) => panic!("{op:?} #{n}: an unexpected error: {other:?}"),
                }
            }
            assert!(
                sim.violations().is_empty(),
                "{op:?} #{n}: {:?}",
                sim.violations()
            );
        }
    }
    // 184 fault points here: 14 group starts, 16 calls, 14 group ends, 53 event records, 73
    // waits and 14 health queries, each reported by one rank or both.
    assert!(points >= 180, "the sweep covers the route: {points} points");
    assert!(
        failures >= points,
        "every fault was reported: {failures} of {points}"
    );
    assert!(started.elapsed() < Duration::from_secs(240), "no rank hung");
}

#[test]
fn a_refused_group_leaves_a_joined_communicator_aborted_and_a_new_one_works() {
    let sim = machine(1);
    ranks(&sim, 1, |_, engine, comm| {
        let t = up(engine, &[1, 2, 3]);
        sim.fail_nth(SimOp::GroupEnd, 1, DriverError::UNKNOWN);
        match comm
            .group()
            .all_reduce(vec![t], ReduceOp::Sum)
            .submit(&mut [&mut *engine])
        {
            Err(SubmitError::Retained {
                error: Error::Library(_),
            }) => {}
            other => panic!("{other:?}"),
        }
        // NCCL leaves such a communicator unusable: it was aborted.
        let t = up(engine, &[4, 5, 6]);
        let t = match comm
            .group()
            .all_reduce(vec![t], ReduceOp::Sum)
            .submit(&mut [&mut *engine])
        {
            Err(SubmitError::Failed {
                input,
                error: Error::Peer(PeerError::Aborted { rank: 0, world: 1 }),
            }) => input,
            other => panic!("{other:?}"),
        };
        engine.synchronize().unwrap();
        let stats = engine.retirement_stats();
        assert_eq!((stats.pending, stats.retained), (0, 0), "{stats:?}");
        let id = UniqueId::new(engine).unwrap();
        let again = Communicator::join(engine, &id, 0, 1).unwrap();
        let summed = again
            .group()
            .all_reduce(t, ReduceOp::Sum)
            .submit(&mut [&mut *engine])
            .unwrap()
            .wait()
            .unwrap()
            .into_parts();
        assert_eq!(down(engine, &summed[0]), [4, 5, 6]);
    });
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn receives_queued_before_their_sends_on_both_ranks_end_by_the_deadline() {
    let world = 2;
    let sim = machine(world);
    let deadline = Duration::from_millis(300);
    ranks(&sim, world, |rank, engine, comm| {
        let comm = comm.with_timeout(deadline);
        let peer = 1 - rank;
        // Each rank waits to receive before it sends, in groups of their own: a deadlock on any
        // device, which the deadline ends on both ranks.
        let into = up(engine, &[0; 4]);
        let received = comm
            .group()
            .recv(peer, 0, into)
            .submit(&mut [&mut *engine])
            .unwrap();
        let mine = up(engine, &values(rank, 4, 0));
        let sent = comm
            .group()
            .send(0, mine, peer)
            .submit(&mut [&mut *engine])
            .unwrap();
        let error = received.wait().unwrap_err();
        assert!(timed_out(&error, rank, world), "{error:?}");
        let error = sent.wait().unwrap_err();
        assert!(
            matches!(error, Error::Peer(PeerError::Aborted { .. })),
            "{error:?}"
        );
        works_on_after_the_abort(engine, &comm);
    });
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0, "every tensor released");
}

// ---- One deadline for a job (issue 37, item 10) ----

#[test]
fn a_join_with_a_missing_rank_names_the_ranks_that_never_joined() {
    use cuferry::error::Error;
    // A world of three where only rank 1 comes: its join ends by the launch's deadline and
    // says that ranks 0 and 2 never joined, as the rendezvous says who never arrived.
    let sim = machine(3);
    let mut engine = CudaEngine::simulated_on_device(&sim, 1).unwrap();
    let id = UniqueId::new(&engine).unwrap();
    let launch = Launch::new(1, 3)
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    match launch.join(&mut engine, &id) {
        Err(error @ Error::Peer(PeerError::Unjoined { .. })) => {
            let Error::Peer(PeerError::Unjoined {
                rank,
                world,
                missing,
                ..
            }) = &error
            else {
                unreachable!()
            };
            assert_eq!((*rank, *world), (1, 3));
            assert_eq!(missing.as_deref(), Some(&[0, 2][..]), "{error}");
            assert!(error.to_string().contains("[0, 2]"), "{error}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_launch_deadline_is_inherited_by_the_rendezvous_the_join_and_the_collectives() {
    use cuferry::collective::{DEFAULT_BOOTSTRAP_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT};
    use cuferry::error::Error;
    let deadline = Duration::from_millis(250);
    let vars: HashMap<&str, String> = HashMap::from([
        ("RANK", "0".to_owned()),
        ("WORLD_SIZE", "2".to_owned()),
        ("MASTER_PORT", free_port().to_string()),
    ]);
    let launch = Launch::from_vars(|v| vars.get(v).cloned())
        .unwrap()
        .with_timeout(deadline);
    assert_eq!(launch.timeout(), Some(deadline));
    // The rendezvous.
    assert_eq!(launch.rendezvous().unwrap().timeout(), deadline);
    // The join: its peer never comes, and it ends by the launch's deadline, not the default.
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let id = UniqueId::new(&engine).unwrap();
    let started = Instant::now();
    match launch.join(&mut engine, &id) {
        Err(Error::Peer(PeerError::Unjoined { waited, .. })) => {
            assert!(waited >= deadline, "{waited:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // The collectives of the communicator it joins, unless told otherwise.
    let alone = Launch::new(0, 1).unwrap().with_timeout(deadline);
    let id = UniqueId::new(&engine).unwrap();
    let comm = alone.join(&mut engine, &id).unwrap();
    assert_eq!(comm.timeout(), deadline);
    assert_eq!(
        comm.clone().with_timeout(Duration::MAX).timeout(),
        Duration::MAX
    );
    // A launch told no deadline keeps each step's default.
    let plain = Launch::new(0, 1).unwrap();
    assert_eq!(plain.timeout(), None);
    assert_eq!(
        plain.rendezvous().unwrap().timeout(),
        DEFAULT_BOOTSTRAP_TIMEOUT
    );
    let id = UniqueId::new(&engine).unwrap();
    let comm = plain.join(&mut engine, &id).unwrap();
    assert_eq!(comm.timeout(), DEFAULT_COLLECTIVE_TIMEOUT);
}
