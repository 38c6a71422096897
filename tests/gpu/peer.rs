//! Peer copies between engines: two engines on device 0, and device 0 and 1 where the machine
//! has a second GPU.

use crate::common::open;
use crate::reference::{assert_same, random_vec, Reference, Rng};
use cuferry::{download_tensor, peer_copy, peer_copy_into, upload_tensor, CudaEngine};

fn round_trip<T: Reference>(a: &mut CudaEngine, b: &mut CudaEngine, rng: &mut Rng) {
    let size = std::mem::size_of::<T>();
    for n in [0, 1, 16 / size, 16 / size + 1, (4 << 20) / size + 3] {
        let data = random_vec::<T>(rng, n);
        let x = upload_tensor(a, &data, &[n]).unwrap();
        let there = peer_copy(a, &x, b).unwrap();
        let what = format!("{} n={n}", T::DTYPE);
        assert_same(&what, &download_tensor(b, &there).unwrap(), &data);
        let mut back = a.alloc_tensor::<T>(&[n]).unwrap();
        peer_copy_into(b, &there, a, &mut back).unwrap();
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
            assert!(a.peer_access(&c).unwrap(), "the GPUs have a peer link");
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
            let there = peer_copy(&mut a, &x, &mut b).unwrap();
            assert_eq!(download_tensor(&mut b, &there).unwrap(), data);
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| one_way(0, 1, &data0));
        s.spawn(|| one_way(1, 0, &data1));
    });
}
