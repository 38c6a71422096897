//! Collectives on a simulated machine of several devices: all-reduce (every operation) and
//! broadcast (every root) for every element type they take, at the size boundaries, with work
//! still queued on every engine; the tensors lent to their engines' next work in flight; the
//! refusals, which hand the tensors back; detach on drop into each engine's queue; a failed wait
//! that retains; and a fault at every driver call of the route.

use crate::support::{Reference, Rng, assert_same, reduce_pair, small_values};
use cuferry::error::{LibraryError, SetupError, UsageError};
use cuferry::sim::{Schedule, SimConfig, SimDevice, SimOp};
use cuferry::{
    CudaEngine, DeviceTensor, Error, SubmitError,
    collective::{CollectiveElement, Communicator, ReduceOp},
    download_tensor,
    error::DriverError,
    upload_tensor, upload_tensor_into,
};

fn machine(devices: usize, seed: u64) -> (SimDevice, Vec<CudaEngine>) {
    let sim = SimDevice::new(SimConfig {
        devices,
        ..SimConfig::default()
    });
    sim.set_schedule(Schedule::Interleaved { seed });
    let engines = (0..devices)
        .map(|d| CudaEngine::simulated_on_device(&sim, d).unwrap())
        .collect();
    (sim, engines)
}

/// Once every engine is gone: the device saw no misuse, and no device memory is left.
fn nothing_left(sim: &SimDevice) {
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0);
}

fn all(engines: &mut [CudaEngine]) -> Vec<&mut CudaEngine> {
    engines.iter_mut().collect()
}

/// Each engine's values uploaded, then scaled by one on the device (still queued when the
/// collective is), as tensors.
fn busy_tensors<T: Reference + CollectiveElement>(
    engines: &mut [CudaEngine],
    values: &[Vec<T>],
) -> Vec<DeviceTensor<T>> {
    engines
        .iter_mut()
        .zip(values)
        .map(|(engine, v)| {
            let t = upload_tensor(engine, v, &[v.len()]).unwrap();
            // A copy queued on the compute stream: the collective must follow it.
            engine.copy_tensor(&t).unwrap()
        })
        .collect()
}

fn check_type<T: Reference + CollectiveElement>(devices: usize, seed: u64) {
    let (sim, mut engines) = machine(devices, seed);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    assert_eq!(comm.ranks(), devices);
    let mut rng = Rng::new(seed);
    let size = std::mem::size_of::<T>();
    for n in [1, 16 / size, 16 / size + 1, (1 << 16) / size + 3] {
        let values: Vec<Vec<T>> = (0..devices)
            .map(|_| small_values::<T>(&mut rng, n))
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min] {
            let tensors = busy_tensors(&mut engines, &values);
            let pending = comm
                .group()
                .all_reduce(tensors, op)
                .submit(&mut all(&mut engines))
                .unwrap();
            let want: Vec<T> = (0..n)
                .map(|i| {
                    values[1..]
                        .iter()
                        .fold(values[0][i], |acc, v| reduce_pair(op, acc, v[i]))
                })
                .collect();
            let what = format!("{} {op:?} n={n} on {devices}", T::DTYPE);
            // The last rank's tensor, read by its engine in flight: after the collective.
            let last = devices - 1;
            let early = download_tensor(&mut engines[last], pending.tensor(last).unwrap()).unwrap();
            assert_same(&format!("{what}, in flight"), &early, &want);
            let back = pending.wait().unwrap().into_parts();
            for (rank, t) in back.iter().enumerate() {
                let got = download_tensor(&mut engines[rank], t).unwrap();
                assert_same(&format!("{what}, rank {rank}"), &got, &want);
            }
        }
        for root in 0..devices {
            let tensors = busy_tensors(&mut engines, &values);
            let back = comm
                .group()
                .broadcast(tensors, root)
                .submit(&mut all(&mut engines))
                .unwrap()
                .wait()
                .unwrap()
                .into_parts();
            for (rank, t) in back.iter().enumerate() {
                let got = download_tensor(&mut engines[rank], t).unwrap();
                let what = format!("{} broadcast from {root} n={n}, rank {rank}", T::DTYPE);
                assert_same(&what, &got, &values[root]);
            }
        }
    }
    drop((comm, engines));
    nothing_left(&sim);
}

#[test]
fn all_reduce_and_broadcast_for_every_element_type_on_two_and_three_devices() {
    for (devices, seed) in [(2, 1), (3, 2)] {
        check_type::<i8>(devices, seed);
        check_type::<u8>(devices, seed);
        check_type::<i32>(devices, seed);
        check_type::<u32>(devices, seed);
        check_type::<i64>(devices, seed);
        check_type::<u64>(devices, seed);
        check_type::<half::f16>(devices, seed);
        check_type::<half::bf16>(devices, seed);
        check_type::<f32>(devices, seed);
        check_type::<f64>(devices, seed);
    }
}

#[test]
fn the_mean_divides_the_sum_by_the_ranks() {
    let (_sim, mut engines) = machine(2, 5);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = vec![
        upload_tensor(&mut engines[0], &[2.0f32, 4.0], &[2]).unwrap(),
        upload_tensor(&mut engines[1], &[4.0f32, 8.0], &[2]).unwrap(),
    ];
    let back = comm
        .group()
        .all_reduce(tensors, ReduceOp::Avg)
        .submit(&mut all(&mut engines))
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_eq!(
        download_tensor(&mut engines[1], &back[1]).unwrap(),
        [3.0, 6.0]
    );
}

/// The mean of `values` (one vector per rank) over a simulated machine of as many devices.
fn mean_over_ranks<T: Reference + CollectiveElement>(values: &[Vec<T>]) -> Vec<T> {
    let sim = SimDevice::new(SimConfig {
        devices: values.len(),
        ..SimConfig::default()
    });
    let mut engines: Vec<CudaEngine> = (0..values.len())
        .map(|d| CudaEngine::simulated_on_device(&sim, d).unwrap())
        .collect();
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = engines
        .iter_mut()
        .zip(values)
        .map(|(e, v)| upload_tensor(e, v, &[v.len()]).unwrap())
        .collect();
    let back = comm
        .group()
        .all_reduce(tensors, ReduceOp::Avg)
        .submit(&mut all(&mut engines))
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    let last = values.len() - 1;
    let got = download_tensor(&mut engines[last], &back[last]).unwrap();
    drop((back, comm, engines));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    got
}

/// The mean over as many ranks as NCCL takes, past what the smallest element types hold (255,
/// 256 and a few hundred), is the sum divided by the rank count, truncated toward zero for
/// integers.
#[test]
fn the_mean_over_hundreds_of_ranks_divides_by_the_rank_count() {
    for ranks in [127usize, 128, 200, 255, 256, 300] {
        // Rank 0 holds the extremes of the 8-bit types, every other rank zeros: the sum is
        // exact, and so is its truncated quotient.
        let ints: Vec<Vec<i8>> = (0..ranks)
            .map(|r| {
                if r == 0 {
                    vec![-128, 127, 100]
                } else {
                    vec![0; 3]
                }
            })
            .collect();
        let want: Vec<i8> = [-128i32, 127, 100]
            .iter()
            .map(|&s| i8::try_from(s / ranks as i32).unwrap())
            .collect();
        assert_eq!(mean_over_ranks(&ints), want, "i8 over {ranks} ranks");
        let uints: Vec<Vec<u8>> = (0..ranks)
            .map(|r| if r == 0 { vec![255, 200] } else { vec![0; 2] })
            .collect();
        let want: Vec<u8> = [255usize, 200]
            .iter()
            .map(|&s| u8::try_from(s / ranks).unwrap())
            .collect();
        assert_eq!(mean_over_ranks(&uints), want, "u8 over {ranks} ranks");
        // Wider integers and floats: every rank holds its rank (negated in the second element).
        let wide: Vec<Vec<i32>> = (0..ranks).map(|r| vec![r as i32, -(r as i32)]).collect();
        let sum = (ranks * (ranks - 1) / 2) as i32;
        let n = ranks as i32;
        assert_eq!(
            mean_over_ranks(&wide),
            [sum / n, -sum / n],
            "i32 over {ranks} ranks"
        );
        let floats: Vec<Vec<f64>> = (0..ranks).map(|r| vec![r as f64]).collect();
        assert_eq!(
            mean_over_ranks(&floats),
            [f64::from(sum) / ranks as f64],
            "f64 over {ranks} ranks"
        );
    }
}

#[test]
fn communicators_take_one_engine_per_device_of_one_machine() {
    let (_sim, mut engines) = machine(2, 6);
    let mut again = CudaEngine::simulated_on_device(&engines[0].sim().unwrap(), 0).unwrap();
    let refused = Communicator::new(&mut [&mut engines[0], &mut again]);
    assert!(
        matches!(
            refused,
            Err(Error::Usage(UsageError::TwoRanksOnOneDevice { .. }))
        ),
        "{refused:?}"
    );
    let mut elsewhere = CudaEngine::simulated(SimConfig::default());
    let refused = Communicator::new(&mut [&mut engines[0], &mut elsewhere]);
    assert!(
        matches!(refused, Err(Error::Setup(SetupError::Unreachable { .. }))),
        "{refused:?}"
    );
    assert!(matches!(
        Communicator::new(&mut []),
        Err(Error::Usage(UsageError::NoEngines { .. }))
    ));
}

#[test]
fn refusals_hand_the_tensors_back_with_nothing_queued() {
    let (sim, mut engines) = machine(2, 7);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let calls = || sim.calls(SimOp::Collective) + sim.calls(SimOp::GroupStart);
    let before = calls();
    let tensors = |engines: &mut [CudaEngine], lens: [usize; 2]| -> Vec<DeviceTensor<u32>> {
        engines
            .iter_mut()
            .zip(lens)
            .map(|(e, n)| upload_tensor(e, &vec![7u32; n], &[n]).unwrap())
            .collect()
    };
    let expect = |refused: SubmitError<Vec<DeviceTensor<u32>>>, is: fn(&Error) -> bool| {
        assert!(is(refused.error()), "{refused}");
        assert!(matches!(refused, SubmitError::Rejected { .. }));
        refused.into_input().expect("handed back")
    };
    // Lengths that differ.
    let t = tensors(&mut engines, [3, 4]);
    let back = expect(
        comm.group()
            .all_reduce(t, ReduceOp::Sum)
            .submit(&mut all(&mut engines))
            .unwrap_err(),
        |e| matches!(e, Error::Usage(UsageError::LengthMismatch { .. })),
    );
    assert_eq!(download_tensor(&mut engines[1], &back[1]).unwrap(), [7; 4]);
    // The engines in another order than the ranks.
    let t = tensors(&mut engines, [3, 3]);
    let (left, right) = engines.split_at_mut(1);
    let back = expect(
        comm.group()
            .broadcast(t, 0)
            .submit(&mut [&mut right[0], &mut left[0]])
            .unwrap_err(),
        |e| matches!(e, Error::Usage(UsageError::WrongEngine { .. })),
    );
    // A root past the last rank; too few tensors; nothing to reduce.
    let back = expect(
        comm.group()
            .broadcast(back, 2)
            .submit(&mut all(&mut engines))
            .unwrap_err(),
        |e| matches!(e, Error::Usage(UsageError::RootOutOfRange { .. })),
    );
    let mut back = back;
    let kept = back.pop().unwrap();
    let back = expect(
        comm.group()
            .all_reduce(back, ReduceOp::Sum)
            .submit(&mut all(&mut engines))
            .unwrap_err(),
        |e| matches!(e, Error::Usage(UsageError::RankCount { .. })),
    );
    drop((back, kept));
    let t = tensors(&mut engines, [0, 0]);
    expect(
        comm.group()
            .all_reduce(t, ReduceOp::Sum)
            .submit(&mut all(&mut engines))
            .unwrap_err(),
        |e| matches!(e, Error::Usage(UsageError::ZeroLength { .. })),
    );
    assert_eq!(calls(), before, "nothing was queued");
}

#[test]
fn dropped_in_flight_each_tensor_detaches_into_its_engine() {
    let (sim, mut engines) = machine(3, 8);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let values = vec![vec![1.0f32; 1000]; 3];
    let tensors = busy_tensors(&mut engines, &values);
    let live = sim.device_live().0;
    sim.hold_clock(true);
    drop(
        comm.group()
            .all_reduce(tensors, ReduceOp::Sum)
            .submit(&mut all(&mut engines))
            .unwrap(),
    );
    for engine in &engines {
        assert_eq!(engine.retirement_stats().pending, 1);
    }
    for engine in &mut engines {
        engine.flush().unwrap();
    }
    assert_eq!(
        sim.device_live().0,
        live,
        "nothing freed under the collective"
    );
    sim.hold_clock(false);
    for engine in &mut engines {
        engine.synchronize().unwrap();
        assert_eq!(engine.retirement_stats().released, 1);
    }
    for engine in &mut engines {
        engine.synchronize().unwrap();
    }
    drop((comm, engines));
    nothing_left(&sim);
}

#[test]
fn forgotten_in_flight_nothing_is_released() {
    let (sim, mut engines) = machine(2, 9);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = busy_tensors(&mut engines, &[vec![1u64; 10], vec![2u64; 10]]);
    std::mem::forget(
        comm.group()
            .all_reduce(tensors, ReduceOp::Max)
            .submit(&mut all(&mut engines))
            .unwrap(),
    );
    for engine in &mut engines {
        engine.synchronize().unwrap();
    }
    drop((comm, engines));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert!(sim.device_live().0 >= 2, "both tensors leaked in place");
}

#[test]
fn a_failed_wait_retains_the_failing_ranks_tensor() {
    let (sim, mut engines) = machine(2, 10);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = vec![
        upload_tensor(&mut engines[0], &[1i32; 64], &[64]).unwrap(),
        upload_tensor(&mut engines[1], &[2i32; 64], &[64]).unwrap(),
    ];
    for engine in &mut engines {
        engine.synchronize().unwrap();
    }
    // The first event recorded next is rank 0's.
    sim.fail_event(1, DriverError::LAUNCH_FAILED);
    let err = comm
        .group()
        .all_reduce(tensors, ReduceOp::Sum)
        .submit(&mut all(&mut engines))
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::DeviceFault {
                what: "collective",
                source: DriverError::LAUNCH_FAILED
            }
        ),
        "{err:?}"
    );
    let _ = engines[0].synchronize();
    assert_eq!(engines[0].retirement_stats().retained, 1);
    engines[1].synchronize().unwrap();
    drop((comm, engines));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(
        sim.device_live().0,
        1,
        "rank 0's tensor retained, rank 1's released"
    );
}

/// The route's driver and library calls, and the failure each is given in the sweep.
const OPS: [(SimOp, DriverError); 7] = [
    (SimOp::GroupStart, DriverError::UNKNOWN),
    (SimOp::Collective, DriverError::INVALID_VALUE),
    (SimOp::GroupEnd, DriverError::UNKNOWN),
    (SimOp::EventRecord, DriverError::UNKNOWN),
    (SimOp::StreamWait, DriverError::INVALID_VALUE),
    (SimOp::OrderRecord, DriverError::UNKNOWN),
    (SimOp::StreamSynchronize, DriverError::LAUNCH_FAILED),
];

/// One all-reduce over two engines with `arm` applied just before it: whether a failure was
/// reported (by the call, its wait, or the next boundary); panics on a wrong result, an untyped
/// error, a violation or a leak.
fn faulted(arm: impl FnOnce(&SimDevice)) -> bool {
    let (sim, mut engines) = machine(2, 11);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = busy_tensors(&mut engines, &[vec![3u32; 500], vec![4u32; 500]]);
    arm(&sim);
    let mut failed = false;
    let mut kept = Vec::new();
    match comm
        .group()
        .all_reduce(tensors, ReduceOp::Sum)
        .submit(&mut all(&mut engines))
    {
        Ok(pending) => match pending.wait() {
            Ok(back) => {
                let back = back.into_parts();
                for (rank, t) in back.iter().enumerate() {
                    match download_tensor(&mut engines[rank], t) {
                        Ok(got) => assert_eq!(got, vec![7; 500]),
                        Err(_) => failed = true,
                    }
                }
                kept = back;
            }
            Err(Error::DeviceFault { .. }) => failed = true,
            Err(other) => panic!("an untyped failure: {other:?}"),
        },
        Err(refused) => {
            failed = true;
            assert!(
                matches!(
                    refused.error(),
                    Error::Driver { .. }
                        | Error::DeviceFault { .. }
                        | Error::Deferred { .. }
                        | Error::Library(LibraryError::Vendor {
                            library: "NCCL",
                            ..
                        })
                ),
                "an untyped failure: {refused}"
            );
            let detached = matches!(refused, SubmitError::Retained { .. });
            assert_eq!(refused.into_input().is_none(), detached);
        }
    }
    sim.clear_faults();
    drop(kept);
    let mut retained = 0;
    for engine in &mut engines {
        failed |= engine.synchronize().is_err();
        retained += engine.retirement_stats().retained;
    }
    drop((comm, engines));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    if retained == 0 {
        assert_eq!(sim.device_live().0, 0, "device memory left allocated");
    }
    failed
}

#[test]
fn a_fault_at_every_call_of_the_route_is_reported_and_loses_nothing() {
    let counts: Vec<u64> = {
        let (sim, mut engines) = machine(2, 11);
        let comm = Communicator::new(&mut all(&mut engines)).unwrap();
        let tensors = busy_tensors(&mut engines, &[vec![3u32; 500], vec![4u32; 500]]);
        let before: Vec<u64> = OPS.iter().map(|&(op, _)| sim.calls(op)).collect();
        drop(
            comm.group()
                .all_reduce(tensors, ReduceOp::Sum)
                .submit(&mut all(&mut engines))
                .unwrap()
                .wait()
                .unwrap()
                .into_parts(),
        );
        OPS.iter()
            .zip(before)
            .map(|(&(op, _), before)| sim.calls(op) - before)
            .collect()
    };
    assert_eq!(counts[..3], [1, 2, 1], "one group, with one part per rank");
    let mut runs = 0;
    for (&(op, error), &count) in OPS.iter().zip(&counts) {
        for n in 1..=count {
            assert!(
                faulted(|sim| sim.fail_nth(op, n, error)),
                "a fault at {op:?} call {n} was not reported"
            );
            runs += 1;
        }
    }
    for n in 1..=2 {
        assert!(
            faulted(|sim| sim.fail_event(n, DriverError::LAUNCH_FAILED)),
            "an event fault at record {n} was not reported"
        );
        runs += 1;
    }
    assert!(runs >= 4, "only {runs} runs");
}

/// NCCL's partial failure: a rank's part refused inside the group, the other rank's launched
/// by the group's end without its partner. The call reports it (`Retained`); the orphaned part
/// fails on its stream, so its rank's tensor is retained for the engine's lifetime and the failure
/// reported once at that engine's next boundary; the refused rank's tensor, which nothing
/// queued touches, is released. Nothing is freed under the device, and nothing hangs.
#[test]
fn a_part_refused_inside_the_group_retains_the_launched_ranks_tensor() {
    let (sim, mut engines) = machine(2, 12);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = busy_tensors(&mut engines, &[vec![1u32; 100], vec![2u32; 100]]);
    sim.fail_nth(SimOp::Collective, 2, DriverError::INVALID_VALUE);
    let refused = comm
        .group()
        .all_reduce(tensors, ReduceOp::Sum)
        .submit(&mut all(&mut engines))
        .unwrap_err();
    assert!(
        matches!(
            &refused,
            SubmitError::Retained {
                error: Error::Library(LibraryError::Vendor {
                    library: "NCCL",
                    call: "ncclAllReduce",
                    ..
                })
            }
        ),
        "{refused}"
    );
    assert!(refused.into_input().is_none(), "nothing can be handed back");
    let first = engines[0].synchronize();
    assert!(
        matches!(
            &first,
            Err(Error::Deferred { count: 1, first })
                if matches!(**first, Error::DeviceFault {
                    what: "collective",
                    source: DriverError::LAUNCH_FAILED,
                })
        ),
        "rank 0's orphaned part failed on its stream: {first:?}"
    );
    engines[0].synchronize().expect("reported once");
    engines[1].synchronize().unwrap();
    assert_eq!(engines[0].retirement_stats().retained, 1);
    assert_eq!(engines[1].retirement_stats().retained, 0);
    // Both engines work on, and so does the communicator.
    let again = busy_tensors(&mut engines, &[vec![5u32; 100], vec![6u32; 100]]);
    let back = comm
        .group()
        .all_reduce(again, ReduceOp::Sum)
        .submit(&mut all(&mut engines))
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_eq!(
        download_tensor(&mut engines[1], &back[1]).unwrap(),
        [11; 100]
    );
    drop((back, comm, engines));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(
        sim.device_live().0,
        1,
        "rank 0's tensor retained, all else freed"
    );
}

/// A refused group end launches nothing: every tensor is released once its engine's event
/// proves the (empty) part of the stream complete, and nothing is retained.
#[test]
fn a_refused_group_end_launches_nothing_and_retains_nothing() {
    let (sim, mut engines) = machine(3, 13);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let values = vec![vec![1.5f32; 64]; 3];
    let tensors = busy_tensors(&mut engines, &values);
    let (groups, parts) = (sim.calls(SimOp::GroupEnd), sim.calls(SimOp::Collective));
    sim.fail_nth(SimOp::GroupEnd, 1, DriverError::UNKNOWN);
    let refused = comm
        .group()
        .all_reduce(tensors, ReduceOp::Max)
        .submit(&mut all(&mut engines))
        .unwrap_err();
    assert!(matches!(refused, SubmitError::Retained { .. }), "{refused}");
    assert_eq!(
        sim.calls(SimOp::Collective) - parts,
        3,
        "every part was added"
    );
    assert_eq!(sim.calls(SimOp::GroupEnd) - groups, 1);
    for engine in &mut engines {
        engine.synchronize().unwrap();
        assert_eq!(engine.retirement_stats().retained, 0);
        assert_eq!(engine.retirement_stats().released, 1);
    }
    drop((comm, engines));
    nothing_left(&sim);
}

/// A refused group start queues nothing: the tensors come back, as they were.
#[test]
fn a_refused_group_start_hands_the_tensors_back() {
    let (sim, mut engines) = machine(2, 14);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = busy_tensors(&mut engines, &[vec![3i64; 8], vec![4i64; 8]]);
    sim.fail_nth(SimOp::GroupStart, 1, DriverError::UNKNOWN);
    let refused = comm
        .group()
        .broadcast(tensors, 1)
        .submit(&mut all(&mut engines))
        .unwrap_err();
    assert!(matches!(refused, SubmitError::Failed { .. }), "{refused}");
    let back = refused.into_input().expect("handed back");
    assert_eq!(download_tensor(&mut engines[0], &back[0]).unwrap(), [3; 8]);
    assert_eq!(download_tensor(&mut engines[1], &back[1]).unwrap(), [4; 8]);
    drop((back, comm, engines));
    nothing_left(&sim);
}

/// Counts its wakes.
#[derive(Default)]
struct Wakes(std::sync::atomic::AtomicUsize);

impl std::task::Wake for Wakes {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn try_wait_hands_the_collective_back_until_every_rank_is_done() {
    use cuferry::pending::TryWait;
    let (sim, mut engines) = machine(3, 11);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = busy_tensors(&mut engines, &[vec![1u32; 64], vec![2; 64], vec![3; 64]]);
    sim.hold_clock(true);
    let mut summed = comm
        .group()
        .all_reduce(tensors, ReduceOp::Sum)
        .submit(&mut all(&mut engines))
        .unwrap();
    assert!(!summed.is_ready().unwrap());
    let summed = match summed.try_wait().unwrap() {
        TryWait::InFlight(summed) => summed,
        TryWait::Returned(_) => panic!("returned before the devices ran it"),
    };
    assert_eq!(summed.tensor_count(), 3);
    sim.hold_clock(false);
    sim.advance_all();
    let returned = match summed.try_wait().unwrap() {
        TryWait::Returned(returned) => returned,
        TryWait::InFlight(_) => panic!("still in flight after every device ran it"),
    };
    for (rank, engine) in engines.iter_mut().enumerate() {
        let got = download_tensor(engine, returned.tensor(rank).unwrap()).unwrap();
        assert_eq!(got, vec![6; 64], "rank {rank}");
    }
    assert!(returned.tensor(3).is_none());
    drop((returned, comm, engines));
    nothing_left(&sim);
}

#[test]
fn an_awaited_collective_is_woken_by_the_devices() {
    use std::future::{Future, IntoFuture};
    use std::sync::Arc;
    use std::task::{Context, Poll, Waker};
    let (sim, mut engines) = machine(2, 12);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = busy_tensors(&mut engines, &[vec![1.5f64; 100], vec![2.5; 100]]);
    sim.hold_clock(true);
    let summed = comm
        .group()
        .all_reduce(tensors, ReduceOp::Sum)
        .submit(&mut all(&mut engines))
        .unwrap();
    let mut future = summed.into_future();
    let wakes = Arc::new(Wakes::default());
    let waker = Waker::from(Arc::clone(&wakes));
    let mut cx = Context::from_waker(&waker);
    assert!(std::pin::Pin::new(&mut future).poll(&mut cx).is_pending());
    assert_eq!(wakes.0.load(std::sync::atomic::Ordering::SeqCst), 0);
    sim.hold_clock(false);
    sim.advance_all();
    let mut polls = 1;
    let returned = loop {
        // Polled again only once woken: each rank's device calls back in turn.
        assert!(
            wakes.0.load(std::sync::atomic::Ordering::SeqCst) >= polls,
            "polled {polls} times, woken fewer"
        );
        match std::pin::Pin::new(&mut future).poll(&mut cx) {
            Poll::Ready(returned) => break returned.unwrap(),
            Poll::Pending => polls += 1,
        }
        sim.advance_all();
    };
    let tensors = returned.into_parts();
    for (rank, engine) in engines.iter_mut().enumerate() {
        assert_eq!(
            download_tensor(engine, &tensors[rank]).unwrap(),
            vec![4.0; 100]
        );
    }
    drop((tensors, comm, engines));
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn an_awaited_collective_dropped_before_it_resolves_detaches_into_each_engine() {
    use std::future::{Future, IntoFuture};
    use std::sync::Arc;
    use std::task::{Context, Waker};
    let (sim, mut engines) = machine(2, 13);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = busy_tensors(&mut engines, &[vec![1u8; 10], vec![2; 10]]);
    let live = sim.device_live().0;
    sim.hold_clock(true);
    let summed = comm
        .group()
        .all_reduce(tensors, ReduceOp::Max)
        .submit(&mut all(&mut engines))
        .unwrap();
    let mut future = summed.into_future();
    let waker = Waker::from(Arc::new(Wakes::default()));
    assert!(
        std::pin::Pin::new(&mut future)
            .poll(&mut Context::from_waker(&waker))
            .is_pending()
    );
    drop(future);
    for engine in &mut engines {
        assert_eq!(engine.retirement_stats().pending, 1);
        engine.flush().unwrap();
    }
    assert_eq!(
        sim.device_live().0,
        live,
        "nothing freed under the collective"
    );
    sim.hold_clock(false);
    for engine in &mut engines {
        engine.synchronize().unwrap();
        assert_eq!(engine.retirement_stats().released, 1);
    }
    drop((comm, engines));
    nothing_left(&sim);
}

#[test]
fn a_resubmitted_collective_runs_again_on_the_same_tensors_and_events() {
    let (sim, mut engines) = machine(2, 14);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let tensors = busy_tensors(&mut engines, &[vec![1i64; 32], vec![2; 32]]);
    let once = comm
        .group()
        .all_reduce(tensors, ReduceOp::Sum)
        .submit(&mut all(&mut engines))
        .unwrap()
        .wait()
        .unwrap();
    let ptrs: Vec<u64> = once.tensors().iter().map(|t| t.sim_address()).collect();
    let events: Vec<u64> = engines.iter().map(|e| e.events_created()).collect();
    // The sum of the sums, on every rank: 3 + 3.
    let twice = once
        .resubmit(&mut all(&mut engines))
        .unwrap()
        .wait()
        .unwrap();
    let again: Vec<u64> = engines.iter().map(|e| e.events_created()).collect();
    assert_eq!(again, events, "the ranks' events were reused");
    let tensors = twice.into_parts();
    assert_eq!(
        tensors.iter().map(|t| t.sim_address()).collect::<Vec<_>>(),
        ptrs,
        "the same tensors"
    );
    for (rank, engine) in engines.iter_mut().enumerate() {
        assert_eq!(
            download_tensor(engine, &tensors[rank]).unwrap(),
            vec![6; 32]
        );
    }
    // A broadcast keeps its root.
    let mut from1 = comm
        .group()
        .broadcast(tensors, 1)
        .submit(&mut all(&mut engines))
        .unwrap()
        .wait()
        .unwrap();
    let (left, right) = engines.split_at_mut(1);
    upload_tensor_into(&mut right[0], &mut from1.tensors_mut()[1], &[9i64; 32]).unwrap();
    let again = from1
        .resubmit(&mut [&mut left[0], &mut right[0]])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_eq!(
        download_tensor(&mut engines[0], &again[0]).unwrap(),
        vec![9; 32]
    );
    // Resubmitted with the engines in another order than the ranks: refused, all back.
    let returned = comm
        .group()
        .broadcast(again, 0)
        .submit(&mut all(&mut engines))
        .unwrap()
        .wait()
        .unwrap();
    let (left, right) = engines.split_at_mut(1);
    match returned.resubmit(&mut [&mut right[0], &mut left[0]]) {
        Err(SubmitError::Rejected { input, error }) => {
            assert!(
                matches!(error, Error::Usage(UsageError::WrongEngine { .. })),
                "{error}"
            );
            assert_eq!(input.len(), 2);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    drop((comm, engines));
    nothing_left(&sim);
}

/// Each engine's values uploaded, untouched by later work.
fn uploaded<T: Reference + CollectiveElement>(
    engines: &mut [CudaEngine],
    values: &[Vec<T>],
) -> Vec<DeviceTensor<T>> {
    engines
        .iter_mut()
        .zip(values)
        .map(|(engine, v)| upload_tensor(engine, v, &[v.len()]).unwrap())
        .collect()
}

fn downloaded<T: Reference + CollectiveElement>(
    engines: &mut [CudaEngine],
    tensors: &[DeviceTensor<T>],
) -> Vec<Vec<T>> {
    engines
        .iter_mut()
        .zip(tensors)
        .map(|(engine, t)| download_tensor(engine, t).unwrap())
        .collect()
}

#[test]
fn reduce_all_gather_and_reduce_scatter_on_three_devices_match_the_reference() {
    for seed in 0..4 {
        let (sim, mut engines) = machine(3, seed);
        let comm = Communicator::new(&mut all(&mut engines)).unwrap();
        let n = 5;
        let values: Vec<Vec<i64>> = (0..3)
            .map(|r| (0..3 * n).map(|i| (r * 100 + i * (r + 1)) as i64).collect())
            .collect();
        // A reduction into rank 1 only, queued behind a copy on every engine.
        let t = busy_tensors(&mut engines, &values);
        let reduced = comm
            .group()
            .reduce(t, ReduceOp::Max, 1)
            .submit(&mut all(&mut engines))
            .unwrap()
            .wait()
            .unwrap()
            .into_parts();
        let got = downloaded(&mut engines, &reduced);
        let max: Vec<i64> = (0..3 * n)
            .map(|i| values.iter().map(|v| v[i]).max().unwrap())
            .collect();
        assert_eq!(got[1], max, "seed {seed}: the root's reduction");
        assert_eq!(got[0], values[0], "seed {seed}: rank 0 untouched");
        assert_eq!(got[2], values[2], "seed {seed}: rank 2 untouched");
        // Every rank's first `n` elements, gathered in rank order on every rank.
        let heads: Vec<Vec<i64>> = values.iter().map(|v| v[..n].to_vec()).collect();
        let inputs = busy_tensors(&mut engines, &heads);
        let outputs = uploaded(&mut engines, &vec![vec![-1i64; 3 * n]; 3]);
        let gathered_parts = comm
            .group()
            .all_gather(inputs, outputs)
            .submit(&mut all(&mut engines))
            .unwrap()
            .wait()
            .unwrap()
            .into_parts();
        assert_eq!(gathered_parts.len(), 6, "the inputs, then the outputs");
        let gathered: Vec<i64> = heads.concat();
        let outputs = downloaded(&mut engines, &gathered_parts[3..]);
        for (rank, got) in outputs.iter().enumerate() {
            assert_eq!(got, &gathered, "seed {seed}: rank {rank}'s gather");
        }
        let inputs = downloaded(&mut engines, &gathered_parts[..3]);
        assert_eq!(inputs, heads, "inputs kept");
        // The sum, rank `r` keeping the `r`-th slice.
        let inputs = busy_tensors(&mut engines, &values);
        let outputs = uploaded(&mut engines, &vec![vec![0i64; n]; 3]);
        let parts = comm
            .group()
            .reduce_scatter(inputs, outputs, ReduceOp::Sum)
            .submit(&mut all(&mut engines))
            .unwrap()
            .wait()
            .unwrap()
            .into_parts();
        for (rank, got) in downloaded(&mut engines, &parts[3..]).iter().enumerate() {
            let want: Vec<i64> = (rank * n..(rank + 1) * n)
                .map(|i| values.iter().map(|v| v[i]).sum())
                .collect();
            assert_eq!(got, &want, "seed {seed}: rank {rank}'s slice");
        }
        drop((reduced, gathered_parts, parts, comm));
        drop(engines);
        nothing_left(&sim);
    }
}

#[test]
fn a_group_runs_a_reduction_and_a_ring_of_sends_as_one_operation_and_again() {
    let (sim, mut engines) = machine(3, 11);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let grads = busy_tensors(
        &mut engines,
        &[vec![1.0f32; 64], vec![2.0; 64], vec![6.0; 64]],
    );
    let mine = uploaded(&mut engines, &[vec![0.0f32; 8], vec![1.0; 8], vec![2.0; 8]]);
    let theirs = uploaded(&mut engines, &vec![vec![-1.0f32; 8]; 3]);
    let mut group = comm.group::<f32>().all_reduce(grads, ReduceOp::Avg);
    for (rank, (mine, theirs)) in mine.into_iter().zip(theirs).enumerate() {
        group = group
            .send(rank, mine, (rank + 1) % 3)
            .recv((rank + 2) % 3, rank, theirs);
    }
    assert_eq!(group.len(), 7);
    let pending = group.submit(&mut all(&mut engines)).unwrap();
    assert_eq!(pending.tensor_count(), 9);
    // Rank 2's received tensor, read by its engine in flight: after the group.
    let early = download_tensor(&mut engines[2], pending.tensor(8).unwrap()).unwrap();
    assert_eq!(early, [1.0; 8]);
    let mut returned = pending.wait().unwrap();
    let check = |engines: &mut [CudaEngine], tensors: &[DeviceTensor<f32>], step: f32| {
        for rank in 0..3 {
            let avg = download_tensor(&mut engines[rank], &tensors[rank]).unwrap();
            assert_eq!(avg, vec![3.0 * step; 64], "rank {rank}'s mean");
            let got = download_tensor(&mut engines[rank], &tensors[4 + 2 * rank]).unwrap();
            let from = ((rank + 2) % 3) as f32;
            assert_eq!(got, vec![from * step; 8], "rank {rank}'s receive");
        }
    };
    check(&mut engines, returned.tensors(), 1.0);
    // The next step: every rank's tensors doubled, the same group again.
    let doubled: Vec<Vec<f32>> = returned
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let rank = if i < 3 { i } else { (i - 3) / 2 };
            let v = download_tensor(&mut engines[rank], t).unwrap();
            v.iter().map(|x| x * 2.0).collect()
        })
        .collect();
    for (i, v) in doubled.iter().enumerate() {
        let rank = if i < 3 { i } else { (i - 3) / 2 };
        upload_tensor_into(&mut engines[rank], &mut returned.tensors_mut()[i], v).unwrap();
    }
    let again = returned
        .resubmit(&mut all(&mut engines))
        .unwrap()
        .wait()
        .unwrap();
    check(&mut engines, again.tensors(), 2.0);
    drop(again);
    drop(engines);
    nothing_left(&sim);
}

#[test]
fn the_calls_check_lengths_roots_and_peers_and_hand_every_tensor_back() {
    let (sim, mut engines) = machine(2, 12);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let calls = || sim.calls(SimOp::Collective) + sim.calls(SimOp::GroupStart);
    let before = calls();
    // Every tensor is dropped at the block's end, before the engines.
    {
        let make = |engines: &mut [CudaEngine], lens: &[usize]| -> Vec<DeviceTensor<u32>> {
            lens.iter()
                .enumerate()
                .map(|(i, &n)| {
                    upload_tensor(&mut engines[i % 2], &vec![i as u32; n], &[n]).unwrap()
                })
                .collect()
        };
        let refused = |r: SubmitError<Vec<DeviceTensor<u32>>>, is: fn(&Error) -> bool| {
            assert!(is(r.error()), "{r}");
            assert!(matches!(r, SubmitError::Rejected { .. }), "{r}");
            r.into_input().expect("handed back")
        };
        let lens = |t: &[DeviceTensor<u32>]| t.iter().map(|t| t.len()).collect::<Vec<_>>();
        // An all-gather's output one element short on rank 1: NCCL would write past it.
        let mut t = make(&mut engines, &[4, 4, 8, 7]);
        let outputs = t.split_off(2);
        let back = refused(
            comm.group()
                .all_gather(t, outputs)
                .submit(&mut all(&mut engines))
                .unwrap_err(),
            |e| {
                matches!(e, Error::Usage(UsageError::LengthMismatch { expected: 8, found: 7, what, .. })
                if what.starts_with("all_gather"))
            },
        );
        assert_eq!(lens(&back), [4, 4, 8, 7], "inputs, then outputs, as given");
        // A reduce-scatter's input not the world's size times its output.
        let mut t = make(&mut engines, &[6, 5, 3, 3]);
        let outputs = t.split_off(2);
        let back = refused(
            comm.group()
                .reduce_scatter(t, outputs, ReduceOp::Sum)
                .submit(&mut all(&mut engines))
                .unwrap_err(),
            |e| {
                matches!(
                    e,
                    Error::Usage(UsageError::LengthMismatch {
                        expected: 6,
                        found: 5,
                        ..
                    })
                )
            },
        );
        assert_eq!(lens(&back), [6, 5, 3, 3]);
        // A reduction's root and a send's peer past the world.
        let t = make(&mut engines, &[3, 3]);
        let t = refused(
            comm.group()
                .reduce(t, ReduceOp::Sum, 2)
                .submit(&mut all(&mut engines))
                .unwrap_err(),
            |e| {
                matches!(
                    e,
                    Error::Usage(UsageError::RootOutOfRange { root: 2, ranks: 2 })
                )
            },
        );
        let mut t = t.into_iter();
        let group = comm
            .group()
            .send(0, t.next().unwrap(), 2)
            .recv(0, 1, t.next().unwrap());
        let back = refused(group.submit(&mut all(&mut engines)).unwrap_err(), |e| {
            matches!(
                e,
                Error::Usage(UsageError::PeerOutOfRange { peer: 2, world: 2 })
            )
        });
        assert_eq!(lens(&back), [3, 3]);
        // A call given one tensor for two ranks: every call's tensors come back.
        let mut t = make(&mut engines, &[2, 2, 2]).into_iter();
        let group = comm
            .group()
            .all_reduce(vec![t.next().unwrap(), t.next().unwrap()], ReduceOp::Sum)
            .broadcast(vec![t.next().unwrap()], 0);
        let back = refused(group.submit(&mut all(&mut engines)).unwrap_err(), |e| {
            matches!(
                e,
                Error::Usage(UsageError::RankCount {
                    ranks: 2,
                    tensors: 1,
                    ..
                })
            )
        });
        assert_eq!(back.len(), 3);
        // An empty group; a send alone on a communicator of two ranks here.
        refused(
            comm.group::<u32>()
                .submit(&mut all(&mut engines))
                .unwrap_err(),
            |e| matches!(e, Error::Usage(UsageError::ZeroLength { .. })),
        );
        let t = make(&mut engines, &[3]).pop().unwrap();
        let t = refused(
            comm.group()
                .send(0, t, 1)
                .submit(&mut [&mut engines[0]])
                .unwrap_err(),
            |e| matches!(e, Error::Usage(UsageError::RankCount { .. })),
        );
        refused(
            comm.group()
                .recv(1, 0, t.into_iter().next().unwrap())
                .submit(&mut [&mut engines[0]])
                .unwrap_err(),
            |e| matches!(e, Error::Usage(UsageError::RankCount { .. })),
        );
    }
    assert_eq!(calls(), before, "nothing was queued");
    drop((comm, engines));
    nothing_left(&sim);
}

#[test]
fn a_send_and_a_receive_that_differ_are_refused_by_the_group_end_and_nothing_is_lost() {
    let (sim, mut engines) = machine(2, 13);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let a = upload_tensor(&mut engines[0], &[1u32; 4], &[4]).unwrap();
    let b = upload_tensor(&mut engines[1], &[2u32; 3], &[3]).unwrap();
    let group = comm.group().send(0, a, 1).recv(0, 1, b);
    match group.submit(&mut all(&mut engines)) {
        Err(SubmitError::Retained {
            error: Error::Library(LibraryError::Vendor { call, .. }),
        }) => assert_eq!(call, "ncclGroupEnd"),
        other => panic!("{other:?}"),
    }
    // Nothing was launched: the tensors are released once each engine proves its stream done.
    for engine in &mut engines {
        engine.synchronize().unwrap();
        assert_eq!(engine.retirement_stats().retained, 0);
        assert_eq!(engine.retirement_stats().released, 1);
    }
    drop((comm, engines));
    nothing_left(&sim);
}

/// An integer mean wraps its sum in the element type before it divides, as NCCL's does (its
/// sum is the element type's, then the quotient truncates toward zero): the docs of
/// `ReduceOp::Avg` say so.
#[test]
fn an_integer_mean_wraps_its_sum_in_the_element_type_before_dividing() {
    // u8: 200 + 200 = 400 wraps to 144, halved 72 (not 200).
    assert_eq!(mean_over_ranks(&[vec![200u8, 3], vec![200, 4]]), [72, 3]);
    // i8: 100 * 3 = 300 wraps to 44, a third 14; -100 * 3 wraps to -44, a third -14.
    let ranks: Vec<Vec<i8>> = (0..3).map(|_| vec![100, -100]).collect();
    assert_eq!(mean_over_ranks(&ranks), [14, -14]);
    // i32: 2^31 - 1 twice wraps to -2, halved -1.
    assert_eq!(mean_over_ranks(&[vec![i32::MAX], vec![i32::MAX]]), [-1]);
    // u64: 2^64 - 1 twice wraps to 2^64 - 2, halved 2^63 - 1.
    assert_eq!(
        mean_over_ranks(&[vec![u64::MAX], vec![u64::MAX]]),
        [u64::MAX / 2]
    );
}

/// A collective moves tensors its caller made; each engine's memory, counted on its own
/// ledger, is its tensors' while they are in flight and after, exactly the device's count of its
/// pool, and nothing once they are gone.
#[test]
fn each_ranks_memory_is_counted_on_its_own_engine_through_a_collective() {
    let (sim, mut engines) = machine(3, 7);
    let comm = Communicator::new(&mut all(&mut engines)).unwrap();
    let values: Vec<Vec<f32>> = (0..3).map(|r| vec![r as f32; 1000]).collect();
    let t = uploaded(&mut engines, &values);
    let in_flight = comm
        .group()
        .all_reduce(t, ReduceOp::Sum)
        .submit(&mut all(&mut engines))
        .unwrap();
    for engine in &engines {
        let m = engine.memory();
        assert_eq!((m.tensors.in_use, m.tensors.count), (4000, 1), "{m}");
        assert_eq!(m.device.unwrap().pool_in_use, 4000);
    }
    let reduced = in_flight.wait().unwrap().into_parts();
    assert_eq!(downloaded(&mut engines, &reduced)[2], vec![3.0; 1000]);
    drop(reduced);
    for engine in &mut engines {
        engine.synchronize().unwrap();
        let m = engine.memory();
        assert_eq!((m.tensors.in_use, m.tensors.peak_in_use), (0, 4000), "{m}");
        assert_eq!(m.device.unwrap().pool_in_use, 0);
    }
    drop(comm);
    drop(engines);
    nothing_left(&sim);
}
