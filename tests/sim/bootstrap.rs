//! The bootstrap of a communicator across processes, on loopback: a unique id as bytes, the TCP
//! rendezvous between ranks on threads of their own, and the launcher's variables. Every wrong
//! input is a typed error saying what was wrong.

use cuferry::collective::{Launch, Rendezvous, UniqueId};
use cuferry::error::BootstrapError;
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
        .timeout(Duration::from_secs(10))
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
        Err(Error::Bootstrap(BootstrapError::UniqueId { reason })) => reason,
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
    std::thread::spawn(move || at(port, 0, world).timeout(timeout).exchange(id))
}

#[test]
fn a_wrong_world_or_job_is_refused_with_the_reason_and_rank_zero_lists_it() {
    let port = free_port();
    let root = serve(port, 3, Duration::from_secs(2));
    let refused = |r: cuferry::Result<UniqueId>| match r {
        Err(Error::Bootstrap(BootstrapError::Refused { reason, .. })) => reason,
        other => panic!("{other:?}"),
    };
    let wrong_world = refused(at(port, 1, 4).exchange(id));
    assert!(wrong_world.contains("a world of 4"), "{wrong_world}");
    let other_job = refused(at(port, 1, 3).job("another").exchange(id));
    assert!(other_job.contains("job \"another\""), "{other_job}");
    // A rank out of its world is refused before any socket is opened.
    assert!(matches!(
        Rendezvous::new(("127.0.0.1", port), 3, 3),
        Err(Error::Bootstrap(BootstrapError::Rank { rank: 3, world: 3 }))
    ));
    match root.join().unwrap() {
        Err(Error::Bootstrap(BootstrapError::Missing {
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
            Err(Error::Bootstrap(BootstrapError::Refused { reason, .. })) => {
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
        Err(Error::Bootstrap(BootstrapError::Garbage { reason, .. })) => {
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
        .timeout(Duration::from_millis(300))
        .exchange(id)
    {
        Err(Error::Bootstrap(BootstrapError::Missing { missing, .. })) => {
            assert_eq!(missing, [1, 2]);
        }
        other => panic!("{other:?}"),
    }
    match at(port, 2, 3)
        .timeout(Duration::from_millis(300))
        .exchange(id)
    {
        Err(Error::Bootstrap(BootstrapError::NoRoot { last, .. })) => {
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
        Err(Error::Bootstrap(e)) => e.to_string(),
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
    use cuferry::collective::{Communicator, ReduceOp, all_reduce, broadcast};
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
                    let summed = all_reduce(&comm, &mut [&mut engine], vec![t], ReduceOp::Sum)
                        .unwrap()
                        .wait()
                        .unwrap()
                        .into_parts();
                    let sum = download_tensor(&mut engine, &summed[0]).unwrap();
                    let from_two = broadcast(&comm, &mut [&mut engine], summed, 2)
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
        Err(Error::Bootstrap(BootstrapError::Rank { rank: 1, world: 1 }))
    ));
    let mut bytes = id.to_bytes();
    bytes[10] = 7; // made by "another library"
    let other = UniqueId::from_bytes(&bytes).unwrap();
    match Communicator::join(&mut engine, &other, 0, 1) {
        Err(Error::Bootstrap(BootstrapError::UniqueId { reason })) => {
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
    match Communicator::join_within(&mut engine, &id, 0, 2, Duration::from_millis(200)) {
        Err(Error::Bootstrap(BootstrapError::Unjoined {
            rank,
            world,
            waited,
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
