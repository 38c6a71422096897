//! NCCL collectives over one engine per GPU: all-reduce (every operation) and broadcast (every
//! root) for every element type NCCL takes, at the size boundaries, the tensors lent to their
//! engines' next work in flight, detached on drop, and the refusals. Needs two GPUs and NCCL;
//! with fewer GPUs or without NCCL it says so and checks the refusal.

use crate::reference::{Reference, Rng, assert_same, reduce_pair, small_values};
use cuferry::error::{PeerError, SetupError, UsageError};
use cuferry::{
    CudaEngine, Error, SubmitError,
    collective::{CollectiveElement, Communicator, ReduceOp},
    download_tensor, upload_tensor,
};

/// Two engines on GPU 0 and 1, and their communicator; `None` (after saying why) without a
/// second GPU or NCCL.
fn pair() -> Option<(CudaEngine, CudaEngine, Communicator)> {
    let mut a = CudaEngine::open(0).unwrap();
    let Ok(mut b) = CudaEngine::open(1) else {
        println!("one GPU: collectives need two");
        let mut c = CudaEngine::open(0).unwrap();
        let refused = Communicator::new(&mut [&mut a, &mut c]);
        assert!(
            matches!(
                refused,
                Err(Error::Usage(UsageError::TwoRanksOnOneDevice { .. })
                    | Error::Setup(SetupError::Unavailable { .. }))
            ),
            "{refused:?}"
        );
        return None;
    };
    match Communicator::new(&mut [&mut a, &mut b]) {
        Ok(comm) => {
            println!("NCCL {:?}", Communicator::nccl_version().unwrap());
            Some((a, b, comm))
        }
        Err(Error::Setup(SetupError::Unavailable { detail, .. })) => {
            println!("no NCCL: {detail}");
            None
        }
        Err(other) => panic!("{other}"),
    }
}

fn check_type<T: CollectiveElement + Reference>(
    a: &mut CudaEngine,
    b: &mut CudaEngine,
    comm: &Communicator,
    rng: &mut Rng,
) {
    let size = std::mem::size_of::<T>();
    for n in [1, 16 / size, 16 / size + 1, (4 << 20) / size + 3] {
        let (x, y) = (small_values::<T>(rng, n), small_values::<T>(rng, n));
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min] {
            let ta = upload_tensor(a, &x, &[n]).unwrap();
            let tb = upload_tensor(b, &y, &[n]).unwrap();
            let pending = comm
                .group()
                .all_reduce(vec![ta, tb], op)
                .submit(&mut [a, b])
                .unwrap();
            // Rank 1's tensor, read by its engine after the collective with no host wait.
            let early = download_tensor(b, pending.tensor(1).unwrap()).unwrap();
            let back = pending.wait().unwrap().into_parts();
            let want: Vec<T> = x
                .iter()
                .zip(&y)
                .map(|(&p, &q)| reduce_pair(op, p, q))
                .collect();
            let what = format!("{} {op:?} n={n}", T::DTYPE);
            assert_same(&format!("{what}: rank 1 in flight"), &early, &want);
            assert_same(
                &format!("{what}: rank 0"),
                &download_tensor(a, &back[0]).unwrap(),
                &want,
            );
            assert_same(
                &format!("{what}: rank 1"),
                &download_tensor(b, &back[1]).unwrap(),
                &want,
            );
        }
        for root in 0..2 {
            let ta = upload_tensor(a, &x, &[n]).unwrap();
            let tb = upload_tensor(b, &y, &[n]).unwrap();
            let back = comm
                .group()
                .broadcast(vec![ta, tb], root)
                .submit(&mut [a, b])
                .unwrap()
                .wait()
                .unwrap()
                .into_parts();
            let want = if root == 0 { &x } else { &y };
            let what = format!("{} broadcast from {root} n={n}", T::DTYPE);
            assert_same(&what, &download_tensor(a, &back[0]).unwrap(), want);
            assert_same(&what, &download_tensor(b, &back[1]).unwrap(), want);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn all_reduce_and_broadcast_for_every_element_type() {
    let Some((mut a, mut b, comm)) = pair() else {
        return;
    };
    let mut rng = Rng::new(0xcc11);
    check_type::<i8>(&mut a, &mut b, &comm, &mut rng);
    check_type::<u8>(&mut a, &mut b, &comm, &mut rng);
    check_type::<i32>(&mut a, &mut b, &comm, &mut rng);
    check_type::<u32>(&mut a, &mut b, &comm, &mut rng);
    check_type::<i64>(&mut a, &mut b, &comm, &mut rng);
    check_type::<u64>(&mut a, &mut b, &comm, &mut rng);
    check_type::<half::f16>(&mut a, &mut b, &comm, &mut rng);
    check_type::<half::bf16>(&mut a, &mut b, &comm, &mut rng);
    check_type::<f32>(&mut a, &mut b, &comm, &mut rng);
    check_type::<f64>(&mut a, &mut b, &comm, &mut rng);
    // The mean, where it is exact.
    let ta = upload_tensor(&mut a, &[2.0f32, 4.0], &[2]).unwrap();
    let tb = upload_tensor(&mut b, &[4.0f32, 8.0], &[2]).unwrap();
    let back = comm
        .group()
        .all_reduce(vec![ta, tb], ReduceOp::Avg)
        .submit(&mut [&mut a, &mut b])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_eq!(download_tensor(&mut b, &back[1]).unwrap(), [3.0, 6.0]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_collective_follows_queued_kernels_and_detaches_on_drop() {
    let Some((mut a, mut b, comm)) = pair() else {
        return;
    };
    let n = 32 << 20;
    let ones = vec![1.0f32; n];
    let (xa, xb) = (
        upload_tensor(&mut a, &ones, &[n]).unwrap(),
        upload_tensor(&mut b, &ones, &[n]).unwrap(),
    );
    for round in 0..4 {
        // Kernels still running on both engines when the collective is queued.
        let mut ya = a.scale(&xa, 2.0).unwrap();
        let mut yb = b.scale(&xb, 3.0).unwrap();
        for _ in 0..4 {
            ya = a.add(&ya, &xa).unwrap();
            yb = b.add(&yb, &xb).unwrap();
        }
        let pending = comm
            .group()
            .all_reduce(vec![ya, yb], ReduceOp::Sum)
            .submit(&mut [&mut a, &mut b])
            .unwrap();
        let za = a.scale(pending.tensor(0).unwrap(), 1.0).unwrap();
        drop(pending); // each tensor detaches into its own engine's queue
        let got = download_tensor(&mut a, &za).unwrap();
        assert!(
            got.iter().all(|&v| v == 13.0),
            "round {round}: {:?}",
            &got[..4]
        );
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert_eq!(
        a.retirement_stats().pending + b.retirement_stats().pending,
        0
    );
    // Refusals hand the tensors back.
    let ta = upload_tensor(&mut a, &[1u32, 2], &[2]).unwrap();
    let tb = upload_tensor(&mut b, &[1u32, 2, 3], &[3]).unwrap();
    let refused = comm
        .group()
        .all_reduce(vec![ta, tb], ReduceOp::Sum)
        .submit(&mut [&mut a, &mut b])
        .unwrap_err();
    assert!(matches!(refused, SubmitError::Rejected { .. }), "{refused}");
    let back = refused.into_input().unwrap();
    assert_eq!(download_tensor(&mut b, &back[1]).unwrap(), [1, 2, 3]);
    let refused = comm
        .group()
        .broadcast(back, 0)
        .submit(&mut [&mut b, &mut a])
        .unwrap_err();
    assert!(
        matches!(
            refused.error(),
            Error::Usage(UsageError::WrongEngine { .. })
        ),
        "{refused}"
    );
}

/// A world of one across processes: the launcher's variables, the rendezvous (which needs no
/// socket for one rank), rank 0's NCCL id, `ncclCommInitRank`, then an all-reduce and a
/// broadcast on the joined communicator.
#[test]
#[ignore = "needs a CUDA device"]
fn a_world_of_one_joins_through_the_bootstrap_and_reduces() {
    use cuferry::collective::{Launch, UniqueId};
    let vars = |name: &str| match name {
        "RANK" => Some("0".to_owned()),
        "WORLD_SIZE" => Some("1".to_owned()),
        "MASTER_PORT" => Some("29533".to_owned()),
        _ => None,
    };
    let launch = Launch::from_vars(vars).unwrap();
    let mut engine = CudaEngine::open(launch.local_rank).unwrap();
    let id = match launch
        .rendezvous()
        .unwrap()
        .exchange(|| UniqueId::new(&engine))
    {
        Ok(id) => id,
        Err(Error::Setup(SetupError::Unavailable { .. })) => {
            println!("no NCCL: nothing to join");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let (major, minor, patch) = Communicator::nccl_version().unwrap();
    assert_eq!(id.library_version(), major * 10000 + minor * 100 + patch);
    let again = UniqueId::from_bytes(&id.to_bytes()).unwrap();
    let comm = Communicator::join(&mut engine, &again, 0, 1).unwrap();
    assert_eq!((comm.rank(), comm.world(), comm.ranks()), (0, 1, 1));
    let data: Vec<f32> = (0..1 << 20).map(|i| i as f32).collect();
    let t = upload_tensor(&mut engine, &data, &[data.len()]).unwrap();
    let summed = comm
        .group()
        .all_reduce(vec![t], ReduceOp::Sum)
        .submit(&mut [&mut engine])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert!(download_tensor(&mut engine, &summed[0]).unwrap() == data);
    let sent = comm
        .group()
        .broadcast(summed, 0)
        .submit(&mut [&mut engine])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert!(download_tensor(&mut engine, &sent[0]).unwrap() == data);
    engine.synchronize().unwrap();
    println!("a world of one joined through ncclCommInitRank (NCCL {major}.{minor}.{patch})");
}

/// The abort path: rank 0 of a world of two whose peer never comes waits its deadline, NCCL's
/// join begun is aborted, and the engine works on (a world of one joins after it).
#[test]
#[ignore = "needs a CUDA device"]
fn a_join_whose_peer_never_comes_is_aborted_by_its_deadline() {
    use cuferry::collective::UniqueId;
    use cuferry::error::Error;
    use std::time::{Duration, Instant};
    let mut engine = CudaEngine::open(0).unwrap();
    let id = match UniqueId::new(&engine) {
        Ok(id) => id,
        Err(Error::Setup(SetupError::Unavailable { .. })) => {
            println!("no NCCL: nothing to join");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let start = Instant::now();
    let launch = cuferry::collective::Launch::new(0, 2)
        .unwrap()
        .with_timeout(Duration::from_secs(3));
    match launch.join(&mut engine, &id) {
        Err(Error::Peer(PeerError::Unjoined { waited, .. })) => {
            println!("the lone rank's join was aborted after {waited:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    let data: Vec<u32> = (0..4096).collect();
    let t = upload_tensor(&mut engine, &data, &[4096]).unwrap();
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), data);
    let alone = UniqueId::new(&engine).unwrap();
    let comm = Communicator::join(&mut engine, &alone, 0, 1).unwrap();
    let summed = comm
        .group()
        .all_reduce(vec![t], ReduceOp::Max)
        .submit(&mut [&mut engine])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_eq!(download_tensor(&mut engine, &summed[0]).unwrap(), data);
    engine.synchronize().unwrap();
}

/// A world of one, joined through the bootstrap (`None` without NCCL).
fn alone(engine: &mut CudaEngine) -> Option<Communicator> {
    use cuferry::collective::UniqueId;
    match UniqueId::new(engine) {
        Ok(id) => Some(Communicator::join(engine, &id, 0, 1).unwrap()),
        Err(Error::Setup(SetupError::Unavailable { .. })) => {
            println!("no NCCL: nothing to join");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// Every collective NCCL runs, on a joined world of one: reduce, all-gather, reduce-scatter,
/// a send to itself with its receive in one group, and an awaited all-reduce, each checked.
#[test]
#[ignore = "needs a CUDA device"]
fn every_collective_runs_on_a_joined_world_of_one() {
    let mut engine = CudaEngine::open(0).unwrap();
    let Some(comm) = alone(&mut engine) else {
        return;
    };
    let n = 1 << 18;
    let data: Vec<i64> = (0..n as i64).map(|i| i * 3 - 7).collect();
    let up = |engine: &mut CudaEngine, v: &[i64]| upload_tensor(engine, v, &[v.len()]).unwrap();
    let t = up(&mut engine, &data);
    let reduced = comm
        .group()
        .reduce(vec![t], ReduceOp::Min, 0)
        .submit(&mut [&mut engine])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert!(download_tensor(&mut engine, &reduced[0]).unwrap() == data);
    let (i, o) = (up(&mut engine, &data), up(&mut engine, &vec![0; n]));
    let gathered = comm
        .group()
        .all_gather(vec![i], vec![o])
        .submit(&mut [&mut engine])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert!(download_tensor(&mut engine, &gathered[1]).unwrap() == data);
    let (i, o) = (up(&mut engine, &data), up(&mut engine, &vec![0; n]));
    let scattered = comm
        .group()
        .reduce_scatter(vec![i], vec![o], ReduceOp::Sum)
        .submit(&mut [&mut engine])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert!(download_tensor(&mut engine, &scattered[1]).unwrap() == data);
    let (mine, theirs) = (up(&mut engine, &data), up(&mut engine, &vec![0; n]));
    let ring = comm.group().send(0, mine, 0).recv(0, 0, theirs);
    let ring = ring
        .submit(&mut [&mut engine])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert!(download_tensor(&mut engine, &ring[1]).unwrap() == data);
    let t = up(&mut engine, &data);
    let pending = comm
        .group()
        .all_reduce(vec![t], ReduceOp::Sum)
        .submit(&mut [&mut engine])
        .unwrap();
    let awaited = futures_lite::future::block_on(pending.into_future())
        .unwrap()
        .into_parts();
    assert!(download_tensor(&mut engine, &awaited[0]).unwrap() == data);
    engine.synchronize().unwrap();
    println!("reduce, all-gather, reduce-scatter, a send to itself and an awaited all-reduce");
}

/// A send to itself without its receive, on a joined world of one: NCCL refuses it at the
/// group's end (after the group started, so the tensor is held until the engine proves its
/// stream done) and leaves the communicator unusable, so it is aborted: a later collective on
/// it is refused with its tensor back, and a new communicator works.
#[test]
#[ignore = "needs a CUDA device"]
fn a_send_without_its_receive_is_refused_by_nccl_and_nothing_is_lost() {
    use cuferry::error::{Error, LibraryError};
    let mut engine = CudaEngine::open(0).unwrap();
    let Some(comm) = alone(&mut engine) else {
        return;
    };
    let t = upload_tensor(&mut engine, &vec![1.0f32; 1 << 20], &[1 << 20]).unwrap();
    let lonely = comm.group().send(0, t, 0);
    match lonely.submit(&mut [&mut engine]) {
        Err(SubmitError::Retained {
            error: Error::Library(LibraryError::Vendor { call, name, .. }),
        }) => println!("NCCL refused the lone send at {call}: {name}"),
        other => panic!("{other:?}"),
    }
    engine.synchronize().unwrap();
    let stats = engine.retirement_stats();
    assert_eq!((stats.pending, stats.retained), (0, 0), "{stats:?}");
    let data: Vec<u32> = (0..4096).collect();
    let t = upload_tensor(&mut engine, &data, &[4096]).unwrap();
    let t = match comm
        .group()
        .all_reduce(vec![t], ReduceOp::Sum)
        .submit(&mut [&mut engine])
    {
        Err(SubmitError::Failed {
            input,
            error: Error::Peer(PeerError::Aborted { .. }),
        }) => input,
        other => panic!("{other:?}"),
    };
    let comm = alone(&mut engine).unwrap();
    let summed = comm
        .group()
        .all_reduce(t, ReduceOp::Sum)
        .submit(&mut [&mut engine])
        .unwrap()
        .wait()
        .unwrap()
        .into_parts();
    assert_eq!(download_tensor(&mut engine, &summed[0]).unwrap(), data);
    engine.synchronize().unwrap();
}
