//! Peer copies between engines: two engines on device 0, and device 0 and 1 where the machine
//! has a second GPU.

use crate::common::open;
use crate::reference::{Reference, Rng, assert_same, random_vec};
use cuferry::{CudaEngine, download_tensor, peer, upload_tensor};

fn round_trip<T: Reference>(a: &mut CudaEngine, b: &mut CudaEngine, rng: &mut Rng) {
    let size = std::mem::size_of::<T>();
    for n in [0, 1, 16 / size, 16 / size + 1, (4 << 20) / size + 3] {
        let data = random_vec::<T>(rng, n);
        let x = upload_tensor(a, &data, &[n]).unwrap();
        let there = peer::copy(a, &x, b).unwrap();
        let what = format!("{} n={n}", T::DTYPE);
        assert_same(&what, &download_tensor(b, &there).unwrap(), &data);
        let mut back = a.alloc_tensor::<T>(&[n]).unwrap();
        peer::copy_into(b, &there, a, &mut back).unwrap();
        assert_same(&what, &download_tensor(a, &back).unwrap(), &data);
    }
}

fn every_type(a: &mut CudaEngine, b: &mut CudaEngine) {
    let mut rng = Rng::new(0x9ee7);
    crate::for_each_element!(T => {
        round_trip::<T>(a, b, &mut rng);
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_element_type_crosses_between_engines() {
    let (mut a, mut b) = (open(), open());
    every_type(&mut a, &mut b);
    match CudaEngine::open(1) {
        Ok(mut c) => {
            assert!(
                peer::access(&mut a, &c).unwrap(),
                "the GPUs have a peer link"
            );
            every_type(&mut a, &mut c);
            println!("peer copies checked between two engines on GPU 0, and GPU 0 and GPU 1");
        }
        Err(_) => println!("peer copies checked between two engines on GPU 0 (no GPU 1)"),
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn peer_copies_in_each_direction_at_once() {
    let Ok(_) = CudaEngine::open(1) else {
        println!("one GPU: the two-direction case needs two");
        return;
    };
    let n = 16 << 20;
    let data0: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let data1: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
    let one_way = |from: usize, to: usize, data: &[f32]| {
        let (mut a, mut b) = (
            CudaEngine::open(from).unwrap(),
            CudaEngine::open(to).unwrap(),
        );
        let x = upload_tensor(&mut a, data, &[data.len()]).unwrap();
        for _ in 0..8 {
            let there = peer::copy(&mut a, &x, &mut b).unwrap();
            assert_eq!(download_tensor(&mut b, &there).unwrap(), data);
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| one_way(0, 1, &data0));
        s.spawn(|| one_way(1, 0, &data1));
    });
}

fn pending_round_trip<T: Reference>(a: &mut CudaEngine, b: &mut CudaEngine, rng: &mut Rng) {
    let size = std::mem::size_of::<T>();
    for n in [1, 16 / size, 16 / size + 1, (4 << 20) / size + 3] {
        let data = random_vec::<T>(rng, n);
        let x = upload_tensor(a, &data, &[n]).unwrap();
        let landing = b.alloc_tensor::<T>(&[n]).unwrap();
        let copy = peer::copy_pending(a, x, b, landing).unwrap();
        let what = format!("pending {} n={n}", T::DTYPE);
        // Handed to the destination engine in flight: its download runs after the copy.
        assert_same(
            &what,
            &download_tensor(b, copy.destination()).unwrap(),
            &data,
        );
        let (x, there) = copy.wait().unwrap().into_parts();
        assert_same(&what, &download_tensor(a, &x).unwrap(), &data);
        assert_same(&what, &download_tensor(b, &there).unwrap(), &data);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_element_type_crosses_pending_between_engines() {
    let (mut a, mut b) = (open(), open());
    let mut rng = Rng::new(0x9ee8);
    crate::for_each_element!(T => {
        pending_round_trip::<T>(&mut a, &mut b, &mut rng);
    });
    if let Ok(mut c) = CudaEngine::open(1) {
        crate::for_each_element!(T => {
            pending_round_trip::<T>(&mut a, &mut c, &mut rng);
            pending_round_trip::<T>(&mut c, &mut a, &mut rng);
        });
        println!("pending peer copies checked GPU 0 to GPU 1 and back");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_pending_copy_follows_the_sources_queued_kernels_and_precedes_the_destinations() {
    let mut a = open();
    let mut b = CudaEngine::open(1).unwrap_or_else(|_| open());
    let n = 32 << 20;
    let data: Vec<f32> = (0..n).map(|i| (i % 4099) as f32).collect();
    let x = upload_tensor(&mut a, &data, &[n]).unwrap();
    for round in 0..4 {
        // A chain of kernels still running on the source engine when the copy is queued.
        let mut y = a.scale(&x, 2.0).unwrap();
        for _ in 0..8 {
            y = a.add(&y, &x).unwrap();
        }
        let landing = b.alloc_tensor::<f32>(&[n]).unwrap();
        let copy = peer::copy_pending(&mut a, y, &mut b, landing).unwrap();
        let z = b.scale(copy.destination(), 0.5).unwrap();
        drop(copy); // detached into the destination engine's queue
        let got = download_tensor(&mut b, &z).unwrap();
        let wrong = got
            .iter()
            .zip(&data)
            .filter(|(g, d)| **g != **d * 5.0)
            .count();
        assert_eq!(wrong, 0, "round {round}: {wrong} elements wrong");
    }
    b.synchronize().unwrap();
    assert_eq!(b.retirement_stats().pending, 0);
}
