//! The bootstrap of a communicator across processes, on loopback: a unique id as bytes, the TCP
//! rendezvous between ranks on threads of their own, and the launcher's variables. Every wrong
//! input is a typed error saying what was wrong.

use cuferry::collective::{Launch, MAX_JOB_BYTES, MAX_UNGREETED, MAX_WORLD, Rendezvous, UniqueId};
use cuferry::error::{MalformedError, PeerError, UsageError};
use cuferry::sim::{SimConfig, SimOp};
use cuferry::{CudaEngine, Error};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// A loopback port no one listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The rendezvous of `rank` in a world of `world` at `port`, with a short deadline.
fn at(port: u16, rank: usize, world: usize) -> Rendezvous {
    Rendezvous::new(("127.0.0.1", port), rank, world)
        .unwrap()
        .job("test")
        .with_timeout(Duration::from_secs(10))
}

/// A fresh id of the simulated machine.
fn id() -> cuferry::Result<UniqueId> {
    UniqueId::new(&CudaEngine::simulated(SimConfig::default()))
}

#[test]
fn every_rank_of_a_world_receives_rank_zeros_id() {
    let port = free_port();
    let world = 4;
    let ids: Vec<UniqueId> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .rev() // the others first: they wait for rank 0 to listen
            .map(|rank| s.spawn(move || at(port, rank, world).exchange(id).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(ids.windows(2).all(|w| w[0] == w[1]), "one id for all");
    assert_eq!(ids[0].library_version(), 0, "the simulator's");
}

#[test]
fn an_id_travels_as_bytes_and_bad_bytes_are_refused() {
    let a = id().unwrap();
    let b = id().unwrap();
    assert_ne!(a, b, "ids are distinct");
    let bytes = a.to_bytes();
    assert_eq!(UniqueId::from_bytes(&bytes).unwrap(), a);
    let bad = |bytes: &[u8]| match UniqueId::from_bytes(bytes) {
        Err(Error::Malformed(MalformedError::UniqueId { reason })) => reason,
        other => panic!("{other:?}"),
    };
    assert!(bad(&bytes[..100]).contains("100 bytes"));
    let mut other = bytes.clone();
    other[0] ^= 1;
    assert!(bad(&other).contains("mark"));
    let mut format = bytes.clone();
    format[8] = 9;
    assert!(bad(&format).contains("format version 9"));
    let engine = CudaEngine::simulated(SimConfig::default());
    engine.sim().unwrap().fail_nth(
        SimOp::UniqueId,
        1,
        cuferry::error::DriverError::INVALID_VALUE,
    );
    assert!(UniqueId::new(&engine).is_err(), "an injected fault");
}

/// Rank 0 serving a world of `world` at `port`, on a thread; its result.
fn serve(
    port: u16,
    world: usize,
    timeout: Duration,
) -> std::thread::JoinHandle<cuferry::Result<UniqueId>> {
    std::thread::spawn(move || at(port, 0, world).with_timeout(timeout).exchange(id))
}

#[test]
fn a_wrong_world_or_job_is_refused_with_the_reason_and_rank_zero_lists_it() {
    let port = free_port();
    let root = serve(port, 3, Duration::from_secs(2));
    let refused = |r: cuferry::Result<UniqueId>| match r {
        Err(Error::Peer(PeerError::RankRefused { reason, .. })) => reason,
        other => panic!("{other:?}"),
    };
    let wrong_world = refused(at(port, 1, 4).exchange(id));
    assert!(wrong_world.contains("a world of 4"), "{wrong_world}");
    let other_job = refused(at(port, 1, 3).job("another").exchange(id));
    assert!(other_job.contains("job \"another\""), "{other_job}");
    // A rank out of its world is refused before any socket is opened.
    assert!(matches!(
        Rendezvous::new(("127.0.0.1", port), 3, 3),
        Err(Error::Usage(UsageError::NotARank { rank: 3, world: 3 }))
    ));
    match root.join().unwrap() {
        Err(Error::Peer(PeerError::Missing {
            missing, refused, ..
        })) => {
            assert_eq!(missing, [1, 2]);
            assert_eq!(refused.len(), 2, "{refused:?}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_rank_taken_twice_is_refused_and_the_world_still_forms() {
    let port = free_port();
    let root = serve(port, 3, Duration::from_secs(10));
    let (one, two) = std::thread::scope(|s| {
        let one = s.spawn(|| at(port, 1, 3).exchange(id));
        // The first rank 1 waits for the id; a second one is refused.
        std::thread::sleep(Duration::from_millis(300));
        match at(port, 1, 3).exchange(id) {
            Err(Error::Peer(PeerError::RankRefused { reason, .. })) => {
                assert!(reason.contains("arrived already"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        let two = s.spawn(|| at(port, 2, 3).exchange(id));
        (one.join().unwrap(), two.join().unwrap())
    });
    let root = root.join().unwrap().unwrap();
    assert_eq!(one.unwrap(), root);
    assert_eq!(two.unwrap(), root);
}

#[test]
fn garbage_on_the_socket_is_refused_both_ways() {
    // At rank 0: a client that is not a rank is refused and listed, and the world still forms.
    let port = free_port();
    let root = serve(port, 2, Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(100));
    let mut junk = loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let peer = at(port, 1, 2).exchange(id).unwrap();
    assert_eq!(root.join().unwrap().unwrap(), peer);
    // At a rank: a "rank 0" that answers with junk is a typed error naming it.
    let port = free_port();
    let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 64];
        let _ = s.read(&mut hello);
        s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").unwrap();
    });
    match at(port, 1, 2).exchange(id) {
        Err(Error::Malformed(MalformedError::Rendezvous { reason, .. })) => {
            assert!(reason.contains("rendezvous mark"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    fake.join().unwrap();
}

#[test]
fn a_rank_that_never_arrives_or_a_rank_zero_that_never_listens_ends_by_the_deadline() {
    let port = free_port();
    let started = std::time::Instant::now();
    match at(port, 0, 3)
        .with_timeout(Duration::from_millis(300))
        .exchange(id)
    {
        Err(Error::Peer(PeerError::Missing { missing, .. })) => {
            assert_eq!(missing, [1, 2]);
        }
        other => panic!("{other:?}"),
    }
    match at(port, 2, 3)
        .with_timeout(Duration::from_millis(300))
        .exchange(id)
    {
        Err(Error::Peer(PeerError::NoRoot { last, .. })) => {
            assert!(last.is_some(), "the refused connections are said");
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn the_launcher_variables_name_the_rank_and_the_rendezvous() {
    let vars = |pairs: &[(&str, &str)]| {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name: &str| map.get(name).cloned()
    };
    let launch = Launch::from_vars(vars(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.7"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap();
    assert_eq!(
        (launch.rank, launch.world, launch.local_rank, launch.port),
        (3, 8, 1, 29500)
    );
    assert_eq!(launch.host, "10.0.0.7");
    // Defaults: the local rank is the rank, rank 0 listens on loopback.
    let launch = Launch::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_PORT", "1"),
    ]))
    .unwrap();
    assert_eq!((launch.local_rank, launch.host.as_str()), (0, "127.0.0.1"));
    let rendezvous = launch.rendezvous().unwrap();
    assert_eq!((rendezvous.rank(), rendezvous.world()), (0, 1));
    let env_error = |pairs: &[(&str, &str)]| match Launch::from_vars(vars(pairs)) {
        Err(e) => e.to_string(),
        other => panic!("{other:?}"),
    };
    assert!(env_error(&[("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]).contains("RANK: not set"));
    assert!(
        env_error(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")])
            .contains("RANK = \"x\"")
    );
    assert!(
        env_error(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")])
            .contains("rank 2 is not a rank of a world of 2")
    );
    assert!(
        env_error(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")])
            .contains("MASTER_PORT")
    );
    // A world of one needs no socket at all.
    let alone = Launch::from_vars(vars(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_PORT", "9"),
    ]))
    .unwrap()
    .rendezvous()
    .unwrap()
    .exchange(id)
    .unwrap();
    assert_eq!(alone.library_version(), 0);
}

#[test]
fn ranks_on_threads_of_their_own_join_through_the_rendezvous_and_reduce_together() {
    use cuferry::collective::{Communicator, ReduceOp};
    use cuferry::sim::SimDevice;
    use cuferry::{download_tensor, upload_tensor};
    let world = 3;
    let sim = SimDevice::new(SimConfig {
        devices: world,
        ..SimConfig::default()
    });
    let port = free_port();
    let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let sim = sim.clone();
                s.spawn(move || {
                    let mut engine = CudaEngine::simulated_on_device(&sim, rank).unwrap();
                    let id = at(port, rank, world)
                        .exchange(|| UniqueId::new(&engine))
                        .unwrap();
                    let comm = Communicator::join(&mut engine, &id, rank, world).unwrap();
                    assert_eq!((comm.rank(), comm.world(), comm.ranks()), (rank, world, 1));
                    let mine: Vec<f32> = (0..1000).map(|i| (i * (rank + 1)) as f32).collect();
                    let t = upload_tensor(&mut engine, &mine, &[1000]).unwrap();
                    let summed = comm
                        .group()
                        .all_reduce(vec![t], ReduceOp::Sum)
                        .submit(&mut [&mut engine])
                        .unwrap()
                        .wait()
                        .unwrap()
                        .into_parts();
                    let sum = download_tensor(&mut engine, &summed[0]).unwrap();
                    let from_two = comm
                        .group()
                        .broadcast(summed, 2)
                        .submit(&mut [&mut engine])
                        .unwrap()
                        .wait()
                        .unwrap()
                        .into_parts();
                    let root_mine = download_tensor(&mut engine, &from_two[0]).unwrap();
                    engine.synchronize().unwrap();
                    (sum, root_mine)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<f32> = (0..1000).map(|i| (i * (1 + 2 + 3)) as f32).collect();
    for (rank, (sum, broadcast)) in results.iter().enumerate() {
        assert_eq!(sum, &want, "rank {rank}'s sum");
        assert_eq!(broadcast, &want, "rank {rank}'s broadcast");
    }
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn a_join_refuses_a_rank_out_of_range_and_an_id_of_another_version() {
    use cuferry::collective::Communicator;
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let id = UniqueId::new(&engine).unwrap();
    assert!(matches!(
        Communicator::join(&mut engine, &id, 1, 1),
        Err(Error::Usage(UsageError::NotARank { rank: 1, world: 1 }))
    ));
    let mut bytes = id.to_bytes();
    bytes[10] = 7; // made by "another library"
    let other = UniqueId::from_bytes(&bytes).unwrap();
    match Communicator::join(&mut engine, &other, 0, 1) {
        Err(Error::Malformed(MalformedError::UniqueId { reason })) => {
            assert!(reason.contains("version 7"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // A world of one joins at once.
    let comm = Communicator::join(&mut engine, &id, 0, 1).unwrap();
    assert_eq!(comm.world(), 1);
}

#[test]
fn a_rank_that_joins_twice_or_with_another_world_is_refused_by_the_library() {
    use cuferry::collective::Communicator;
    use cuferry::sim::SimDevice;
    let sim = SimDevice::new(SimConfig {
        devices: 2,
        ..SimConfig::default()
    });
    let mut a = CudaEngine::simulated_on_device(&sim, 0).unwrap();
    let mut b = CudaEngine::simulated_on_device(&sim, 1).unwrap();
    let id = UniqueId::new(&a).unwrap();
    std::thread::scope(|s| {
        let first = s.spawn(|| Communicator::join(&mut a, &id, 0, 2));
        std::thread::sleep(Duration::from_millis(100));
        // Rank 0 again, and a world of another size: the library refuses both at once.
        for (rank, world, what) in [(0, 2, "joined twice"), (1, 3, "a world of 3")] {
            match Communicator::join(&mut b, &id, rank, world) {
                Err(Error::Library(e)) => assert!(e.to_string().contains(what), "{e}"),
                other => panic!("{other:?}"),
            }
        }
        // Then the right rank completes the world, and both joins return.
        let second = Communicator::join(&mut b, &id, 1, 2).unwrap();
        assert_eq!(second.rank(), 1);
        assert_eq!(first.join().unwrap().unwrap().rank(), 0);
    });
    // An id of another simulated machine is refused.
    let other = UniqueId::new(&CudaEngine::simulated(SimConfig::default())).unwrap();
    match Communicator::join(&mut b, &other, 0, 1) {
        Err(Error::Library(e)) => assert!(e.to_string().contains("another machine"), "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_join_whose_peer_never_comes_ends_by_its_deadline_and_the_engine_works_on() {
    use cuferry::collective::Communicator;
    use cuferry::{download_tensor, upload_tensor};
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let id = UniqueId::new(&engine).unwrap();
    let started = std::time::Instant::now();
    let launch = Launch::new(0, 2)
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    match launch.join(&mut engine, &id) {
        Err(Error::Peer(PeerError::Unjoined {
            rank,
            world,
            waited,
            ..
        })) => {
            assert_eq!((rank, world), (0, 2));
            assert!(waited >= Duration::from_millis(200), "{waited:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // The engine works on, and a world of one joins with a fresh id.
    let t = upload_tensor(&mut engine, &[1u32, 2, 3], &[3]).unwrap();
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), [1, 2, 3]);
    let alone = UniqueId::new(&engine).unwrap();
    assert_eq!(
        Communicator::join(&mut engine, &alone, 0, 1)
            .unwrap()
            .world(),
        1
    );
}

// ---- Hostile peers, strangers and settings (issue 36) ----

/// The rendezvous protocol's mark (its last byte the version), and its message kinds.
const MARK: &[u8; 8] = b"CFRDZV\x00\x01";
const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const REFUSE: u8 = 3;

/// One rendezvous message: the mark, its kind, the length it claims, its body.
fn message(kind: u8, claimed: u32, body: &[u8]) -> Vec<u8> {
    let mut out = MARK.to_vec();
    out.push(kind);
    out.extend_from_slice(&claimed.to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// A greeting's body: rank, world, job.
fn hello_body(rank: u64, world: u64, job: &[u8]) -> Vec<u8> {
    let mut out = rank.to_le_bytes().to_vec();
    out.extend_from_slice(&world.to_le_bytes());
    out.extend_from_slice(job);
    out
}

/// A connection to rank 0 at `port`, once it listens.
fn connect(port: u16) -> TcpStream {
    let started = std::time::Instant::now();
    loop {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
            return s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "rank 0 never listened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Writes `bytes` one at a time, `every` apart, until they end, `stop` is set or the peer
/// closes.
fn trickle(
    stream: &mut TcpStream,
    bytes: &[u8],
    every: Duration,
    stop: &std::sync::atomic::AtomicBool,
) {
    for b in bytes {
        if stop.load(std::sync::atomic::Ordering::Relaxed) || stream.write_all(&[*b]).is_err() {
            return;
        }
        std::thread::sleep(every);
    }
}

#[test]
fn a_stranger_that_trickles_holds_rank_zero_no_longer_than_its_deadline() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let port = free_port();
    let timeout = Duration::from_millis(500);
    let started = std::time::Instant::now();
    let root = serve(port, 2, timeout);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut stranger = connect(port);
            // A well-formed greeting's start, then its body, a byte every 50 ms (10 s in all).
            let bytes = message(HELLO, 200, &[b'x'; 200]);
            trickle(&mut stranger, &bytes, Duration::from_millis(50), &stop);
        });
        let outcome = root.join().unwrap();
        let held = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        match outcome {
            Err(Error::Peer(PeerError::Missing { missing, .. })) => {
                assert_eq!(missing, [1])
            }
            other => panic!("{other:?}"),
        }
        assert!(
            held < timeout * 2,
            "rank 0 was held {held:?} by a {timeout:?} deadline"
        );
    });
}

#[test]
fn a_rank_zero_that_trickles_its_answer_holds_a_rank_no_longer_than_its_deadline() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let stop = AtomicBool::new(false);
    let timeout = Duration::from_millis(500);
    std::thread::scope(|s| {
        s.spawn(|| {
            let (mut fake, _) = listener.accept().unwrap();
            let mut hello = [0u8; 64];
            let _ = fake.read(&mut hello);
            // A well-formed answer with a good id, a byte every 50 ms (about 8 s in all).
            let bytes = message(WELCOME, 142, &id().unwrap().to_bytes());
            trickle(&mut fake, &bytes, Duration::from_millis(50), &stop);
        });
        let started = std::time::Instant::now();
        let outcome = at(port, 1, 2).with_timeout(timeout).exchange(id);
        let held = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        match outcome {
            Err(Error::Peer(PeerError::NoRoot { .. })) => {}
            other => panic!("{other:?} after {held:?}"),
        }
        assert!(
            held < timeout * 2,
            "the rank was held {held:?} by a {timeout:?} deadline"
        );
    });
}

#[test]
fn strangers_holding_idle_connections_do_not_stop_a_world_from_forming() {
    let port = free_port();
    let world = 4;
    let timeout = Duration::from_secs(5);
    let started = std::time::Instant::now();
    let root = serve(port, world, timeout);
    // 150 connections that never say a word, opened before any real rank.
    let mut strangers: Vec<TcpStream> = (0..150).map(|_| connect(port)).collect();
    std::thread::sleep(Duration::from_millis(300));
    // Rank 0 holds a bounded number of them: those past its bound are closed.
    let closed = strangers
        .iter_mut()
        .map(closed_by_peer)
        .filter(|&c| c)
        .count();
    assert!(
        closed >= 150 - MAX_UNGREETED,
        "rank 0 still holds {} idle connections",
        150 - closed
    );
    let ids: Vec<UniqueId> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..world)
            .map(|rank| s.spawn(move || at(port, rank, world).with_timeout(timeout).exchange(id)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    });
    let root = root.join().unwrap().unwrap();
    assert!(ids.iter().all(|i| *i == root));
    assert!(started.elapsed() < timeout, "{:?}", started.elapsed());
    drop(strangers);
}

/// Whether the peer closed `stream` (after whatever it wrote), without waiting for more.
fn closed_by_peer(stream: &mut TcpStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_millis(1)))
        .unwrap();
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

/// Rank 0's answer on `stream` until it closes: `(kind, body)`, or `None` for none.
fn answer(stream: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut all = Vec::new();
    let _ = stream.read_to_end(&mut all);
    if all.len() < 13 || &all[..8] != MARK {
        return None;
    }
    let len = u32::from_le_bytes(all[9..13].try_into().unwrap()) as usize;
    Some((all[8], all.get(13..13 + len)?.to_vec()))
}

#[test]
fn every_field_of_a_greeting_is_checked_before_it_sizes_anything_and_the_world_still_forms() {
    let port = free_port();
    let root = serve(port, 3, Duration::from_secs(10));
    let long = hello_body(1, 3, &[b'j'; 3984]);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "not the protocol",
            b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            "mark",
        ),
        (
            "another version",
            {
                let mut m = message(HELLO, 20, &hello_body(1, 3, b"test"));
                m[7] = 2;
                m
            },
            "version 2",
        ),
        ("another kind", message(WELCOME, 4, b"abcd"), "kind 2"),
        (
            "a 4 GiB length",
            message(HELLO, u32::MAX, &[]),
            "4294967295 bytes",
        ),
        (
            "a length past a greeting's",
            message(HELLO, 4000, &long),
            "4000 bytes",
        ),
        ("a body too short", message(HELLO, 8, &[0; 8]), "8 bytes"),
        (
            "the largest rank",
            message(HELLO, 20, &hello_body(u64::MAX, 3, b"test")),
            "rank 18446744073709551615",
        ),
        (
            "rank 0",
            message(HELLO, 20, &hello_body(0, 3, b"test")),
            "rank 0",
        ),
        (
            "the world's size as a rank",
            message(HELLO, 20, &hello_body(3, 3, b"test")),
            "rank 3",
        ),
        (
            "the largest world",
            message(HELLO, 20, &hello_body(1, u64::MAX, b"test")),
            "a world of 18446744073709551615",
        ),
        (
            "a job not UTF-8",
            message(HELLO, 18, &hello_body(1, 3, b"\xff\xfe")),
            "UTF-8",
        ),
        (
            "another job",
            message(HELLO, 21, &hello_body(1, 3, b"other")),
            "job \"other\"",
        ),
    ];
    for (what, bytes, why) in &cases {
        let mut stranger = connect(port);
        stranger.write_all(bytes).unwrap();
        match answer(&mut stranger) {
            Some((REFUSE, reason)) => {
                let reason = String::from_utf8(reason).unwrap();
                assert!(reason.contains(why), "{what}: {reason}");
            }
            other => panic!("{what}: {other:?} where a refusal belongs"),
        }
    }
    let ids: Vec<UniqueId> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..3)
            .map(|rank| s.spawn(move || at(port, rank, 3).exchange(id)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    });
    let root = root.join().unwrap().unwrap();
    assert!(ids.iter().all(|i| *i == root));
}

/// A fake rank 0 at a fresh port that answers each connection with the next of `answers`
/// (after reading the greeting), then closes it; `None` closes it unanswered and unread.
fn fake_root(answers: Vec<Option<Vec<u8>>>) -> (u16, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let handle = std::thread::spawn(move || {
        for answer in answers {
            let (mut s, _) = listener.accept().unwrap();
            if let Some(answer) = answer {
                let mut hello = [0u8; 64];
                let _ = s.read(&mut hello);
                let _ = s.write_all(&answer);
            }
        }
    });
    (port, handle)
}

#[test]
fn every_field_of_rank_zeros_answer_is_checked_before_it_sizes_anything() {
    let good = id().unwrap().to_bytes();
    let mut other_mark = good.clone();
    other_mark[0] ^= 1;
    let mut other_format = good.clone();
    other_format[8] = 9;
    let garbage = |why: &'static str| move |e: &Error| matches!(e, Error::Malformed(MalformedError::Rendezvous { reason, .. }) if reason.contains(why));
    type Check = Box<dyn Fn(&Error) -> bool>;
    let cases: Vec<(&str, Vec<u8>, Check)> = vec![
        (
            "not the protocol",
            b"SSH-2.0-OpenSSH_9.6\r\n".to_vec(),
            Box::new(garbage("mark")),
        ),
        (
            "another version",
            {
                let mut m = message(WELCOME, 142, &good);
                m[7] = 2;
                m
            },
            Box::new(garbage("version 2")),
        ),
        (
            "another kind",
            message(9, 0, &[]),
            Box::new(garbage("kind 9")),
        ),
        (
            "a greeting back",
            message(HELLO, 20, &hello_body(1, 2, b"test")),
            Box::new(garbage("kind 1")),
        ),
        (
            "a 4 GiB id",
            message(WELCOME, u32::MAX, &[]),
            Box::new(garbage("4294967295 bytes")),
        ),
        (
            "an id cut short",
            message(WELCOME, 141, &good[..141]),
            Box::new(garbage("141 bytes")),
        ),
        (
            "an id too long",
            message(WELCOME, 143, &[&good[..], &[0]].concat()),
            Box::new(garbage("143 bytes")),
        ),
        (
            "a reason past its bound",
            message(REFUSE, 5000, &[b'r'; 5000]),
            Box::new(garbage("5000 bytes")),
        ),
        (
            "an id without its mark",
            message(WELCOME, 142, &other_mark),
            Box::new(
                |e: &Error| matches!(e, Error::Malformed(MalformedError::UniqueId { reason }) if reason.contains("mark")),
            ),
        ),
        (
            "an id of another format",
            message(WELCOME, 142, &other_format),
            Box::new(
                |e: &Error| matches!(e, Error::Malformed(MalformedError::UniqueId { reason }) if reason.contains("format version 9")),
            ),
        ),
        (
            "a reason of control bytes",
            message(REFUSE, 8, b"\x1b[2J\xffok!"),
            Box::new(|e: &Error| {
                matches!(e, Error::Peer(PeerError::RankRefused { reason, .. })
                if reason.contains("ok!") && !reason.contains('\x1b'))
            }),
        ),
        (
            "an answer cut short",
            message(WELCOME, 142, &good[..20]),
            Box::new(|e: &Error| {
                matches!(
                    e,
                    Error::Peer(PeerError::NoRoot { .. })
                        | Error::Malformed(MalformedError::Rendezvous { .. })
                )
            }),
        ),
    ];
    for (what, answer, check) in cases {
        let (port, fake) = fake_root(vec![Some(answer)]);
        match at(port, 1, 2)
            .with_timeout(Duration::from_secs(2))
            .exchange(id)
        {
            Err(e) => assert!(check(&e), "{what}: {e:?}"),
            other => panic!("{what}: {other:?}"),
        }
        fake.join().unwrap();
    }
}

#[test]
fn a_rank_whose_connection_is_closed_unanswered_connects_again() {
    let good = id().unwrap();
    let answer = message(WELCOME, 142, &good.to_bytes());
    let (port, fake) = fake_root(vec![None, None, Some(answer)]);
    let got = at(port, 1, 2)
        .with_timeout(Duration::from_secs(5))
        .exchange(id)
        .unwrap();
    assert_eq!(got, good);
    fake.join().unwrap();
}

/// The launcher's variables `pairs` name, as `Launch::from_vars` reads them.
fn launch(pairs: &[(&str, &str)]) -> cuferry::Result<Launch> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Launch::from_vars(move |name| map.get(name).cloned())
}

#[test]
fn every_launcher_variable_is_bounded_and_a_refusal_says_the_limit() {
    let base = [
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.7"),
        ("MASTER_PORT", "29500"),
    ];
    let with = |name: &str, value: &str| -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = base
            .iter()
            .filter(|(k, _)| *k != name)
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        v.push((name.to_owned(), value.to_owned()));
        v
    };
    let refused = |name: &str, value: &str| -> String {
        let pairs = with(name, value);
        let pairs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        match launch(&pairs) {
            Err(e) => e.to_string(),
            other => panic!("{name}={value:?} gave {other:?}"),
        }
    };
    let huge = "1000000000000000";
    let max = MAX_WORLD.to_string();
    let past = (MAX_WORLD + 1).to_string();
    let long_host = "h".repeat(300);
    let long_value = "9".repeat(10_000);
    let cases: Vec<(&str, &str, &str)> = vec![
        ("WORLD_SIZE", huge, &max),
        ("WORLD_SIZE", &past, &max),
        ("WORLD_SIZE", "0", "WORLD_SIZE"),
        ("WORLD_SIZE", "-4", "WORLD_SIZE"),
        ("WORLD_SIZE", &long_value, "WORLD_SIZE"),
        ("RANK", huge, "rank 1000000000000000"),
        ("RANK", "4", "rank 4"),
        ("RANK", "-1", "RANK"),
        ("LOCAL_RANK", "4", "LOCAL_RANK"),
        ("LOCAL_RANK", huge, "LOCAL_RANK"),
        ("LOCAL_RANK", "x", "LOCAL_RANK"),
        ("LOCAL_WORLD_SIZE", "5", "LOCAL_WORLD_SIZE"),
        ("LOCAL_WORLD_SIZE", "0", "LOCAL_WORLD_SIZE"),
        ("LOCAL_WORLD_SIZE", "1", "LOCAL_RANK"),
        ("MASTER_PORT", "0", "MASTER_PORT"),
        ("MASTER_PORT", "65536", "MASTER_PORT"),
        ("MASTER_ADDR", "", "MASTER_ADDR"),
        ("MASTER_ADDR", "   ", "MASTER_ADDR"),
        ("MASTER_ADDR", "a host", "MASTER_ADDR"),
        ("MASTER_ADDR", "10.0.0.7:29500", "MASTER_ADDR"),
        ("MASTER_ADDR", "ho\nst", "MASTER_ADDR"),
        ("MASTER_ADDR", "-bad-.example", "MASTER_ADDR"),
        ("MASTER_ADDR", "a..b", "MASTER_ADDR"),
        ("MASTER_ADDR", &long_host, "253"),
    ];
    for (name, value, says) in cases {
        let message = refused(name, value);
        assert!(message.contains(says), "{name}={value:.40}: {message}");
        assert!(
            message.len() < 400,
            "the value is echoed cut short: {} bytes",
            message.len()
        );
    }
    // The forms a launcher writes are read.
    for (host, read) in [
        ("10.0.0.7", "10.0.0.7"),
        ("::1", "::1"),
        ("[fe80::1]", "fe80::1"),
        ("node-3.cluster.local", "node-3.cluster.local"),
        (" localhost ", "localhost"),
        ("gpu_07", "gpu_07"),
    ] {
        let pairs = with("MASTER_ADDR", host);
        let pairs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(launch(&pairs).unwrap().host, read, "{host:?}");
    }
    let pairs = with("LOCAL_WORLD_SIZE", "2");
    let pairs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(launch(&pairs).unwrap().local_rank, 1);
    let pairs = with("WORLD_SIZE", &max);
    let pairs: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(launch(&pairs).unwrap().world, MAX_WORLD);
}

#[test]
fn a_rendezvous_refuses_a_world_or_a_job_past_its_bound_before_it_sizes_anything() {
    let big = 1_000_000_000_000_000usize;
    assert_eq!(MAX_WORLD, 262_144, "the documented bound");
    for (rank, world) in [(0, big), (1, big), (0, MAX_WORLD + 1)] {
        match Rendezvous::new(("127.0.0.1", 1), rank, world) {
            Err(e) => {
                assert!(e.to_string().contains(&MAX_WORLD.to_string()), "{e}")
            }
            other => panic!("a world of {world}: {other:?}"),
        }
    }
    let port = free_port();
    for rank in [0, 1] {
        match at(port, rank, 2)
            .job("j".repeat(MAX_JOB_BYTES + 1))
            .with_timeout(Duration::from_millis(200))
            .exchange(id)
        {
            Err(e) => {
                assert!(e.to_string().contains(&MAX_JOB_BYTES.to_string()), "{e}")
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
    // A name at the bound is a name.
    let job = "j".repeat(MAX_JOB_BYTES);
    let ids: Vec<UniqueId> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let job = job.clone();
                s.spawn(move || at(port, rank, 2).job(job).exchange(id).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(ids[0], ids[1]);
}

#[test]
fn a_rendezvous_a_join_and_collectives_with_no_deadline_complete() {
    joined_with_no_deadline(Duration::MAX);
}

#[test]
fn collectives_of_joined_ranks_with_no_deadline_complete() {
    // The rendezvous with a deadline: only the join and the collectives have none.
    joined_with_no_deadline(Duration::from_secs(10));
}

/// A world of two joined ranks, whose rendezvous waits `rendezvous`, whose join and
/// collectives have no deadline: a wait and an `.await` of an all-reduce.
fn joined_with_no_deadline(rendezvous: Duration) {
    use cuferry::collective::{Launch, ReduceOp};
    use cuferry::sim::SimDevice;
    use cuferry::{download_tensor, upload_tensor};
    let world = 2;
    let sim = SimDevice::new(SimConfig {
        devices: world,
        ..SimConfig::default()
    });
    let port = free_port();
    let sums: Vec<(Vec<u32>, Vec<u32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let sim = sim.clone();
                s.spawn(move || {
                    let mut engine = CudaEngine::simulated_on_device(&sim, rank).unwrap();
                    let id = at(port, rank, world)
                        .with_timeout(rendezvous)
                        .exchange(|| UniqueId::new(&engine))
                        .unwrap();
                    let comm = Launch::new(rank, world)
                        .unwrap()
                        .with_timeout(Duration::MAX)
                        .join(&mut engine, &id)
                        .unwrap()
                        .with_timeout(Duration::MAX);
                    let t = upload_tensor(&mut engine, &[rank as u32 + 1; 8], &[8]).unwrap();
                    let waited = comm
                        .group()
                        .all_reduce(vec![t], ReduceOp::Sum)
                        .submit(&mut [&mut engine])
                        .unwrap()
                        .wait()
                        .unwrap()
                        .into_parts();
                    let first = download_tensor(&mut engine, &waited[0]).unwrap();
                    let pending = comm
                        .group()
                        .all_reduce(waited, ReduceOp::Sum)
                        .submit(&mut [&mut engine])
                        .unwrap();
                    let awaited = futures_lite::future::block_on(pending.into_future())
                        .unwrap()
                        .into_parts();
                    let second = download_tensor(&mut engine, &awaited[0]).unwrap();
                    engine.synchronize().unwrap();
                    (first, second)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (first, second) in sums {
        assert_eq!(first, [3; 8]);
        assert_eq!(second, [6; 8]);
    }
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}
