//! Checkpoint files on the GPU: a file the format's own serializer wrote loads bit for bit and
//! saves back byte for byte, and the load's rate, with its staging slots made, beside a plain
//! read of the same file into pinned memory (`docs/records/checkpoints.md`).

use crate::engine;
use cuferry::checkpoint::{self, Tensor};
use cuferry::staging::StagingConfig;
use cuferry::{PinnedHostBuffer, download_tensor};
use std::collections::HashMap;
use std::time::Instant;

#[test]
#[ignore = "needs a CUDA device"]
fn a_checkpoint_loads_bit_for_bit_and_saves_back_byte_for_byte() {
    let dir = std::env::temp_dir().join(format!("cuferry-gpu-checkpoint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    // 32 bf16 tensors of 32 MiB: 1 GiB, distinct bytes per tensor.
    let tensors: Vec<(String, Vec<u8>)> = (0..32u8)
        .map(|i| {
            let bytes = (0..32usize << 20)
                .map(|j| (j as u8).wrapping_mul(31).wrapping_add(i))
                .collect();
            (format!("layer.{i:02}.weight"), bytes)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, b)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::BF16,
                vec![b.len() / 2],
                b,
            )
            .unwrap();
            (n.clone(), view)
        })
        .collect();
    let file = safetensors::serialize(views, None::<HashMap<String, String>>).unwrap();
    std::fs::write(&path, &file).unwrap();
    let total = file.len() as f64;
    let mut engine = engine();
    // A warm page cache: one read of the file first.
    let _ = std::fs::read(&path).unwrap();
    for (chunk, depth) in [
        (16usize << 20, 4usize),
        (8 << 20, 32),
        (4 << 20, 32),
        (16 << 20, 32),
    ] {
        let mut config = StagingConfig::default();
        config.chunk_bytes = chunk;
        config.ring_depth = depth;
        engine.set_staging_config(config).unwrap();
        // A first load makes the staging slots (page-locked allocations); the second is timed.
        drop(checkpoint::load(&mut engine, &path).unwrap());
        engine.synchronize().unwrap();
        let start = Instant::now();
        let loaded = checkpoint::load(&mut engine, &path).unwrap();
        let secs = start.elapsed().as_secs_f64();
        println!(
            "load, {} MiB x {depth} slots: {:.1} GiB/s ({:.3} s for {:.0} MiB)",
            chunk >> 20,
            total / secs / f64::from(1u32 << 30),
            secs,
            total / f64::from(1u32 << 20)
        );
        for (name, bytes) in tensors.iter().step_by(5) {
            let t = loaded.get(name).unwrap();
            assert_eq!(
                &download_tensor(&mut engine, t.bytes()).unwrap(),
                bytes,
                "{name}"
            );
        }
        let out = dir.join("again.safetensors");
        let named: Vec<(&str, &Tensor)> = loaded.iter().collect();
        let start = Instant::now();
        checkpoint::save(&mut engine, &out, &named).unwrap();
        let secs = start.elapsed().as_secs_f64();
        println!(
            "save, {} MiB x {depth} slots: {:.1} GiB/s",
            chunk >> 20,
            total / secs / f64::from(1u32 << 30)
        );
        assert!(
            std::fs::read(&out).unwrap() == file,
            "the saved file is the serializer's"
        );
        std::fs::remove_file(&out).unwrap();
    }
    // The baseline: 16 threads reading the file into pinned memory, positioned reads.
    let mut pinned = PinnedHostBuffer::<u8>::new(&mut engine, file.len()).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let piece = file.len().div_ceil(16);
    let start = Instant::now();
    std::thread::scope(|s| {
        for (t, dst) in pinned.as_mut_slice().chunks_mut(piece).enumerate() {
            let f = &f;
            s.spawn(move || {
                use std::os::unix::fs::FileExt;
                f.read_exact_at(dst, (t * piece) as u64).unwrap();
            });
        }
    });
    let secs = start.elapsed().as_secs_f64();
    println!(
        "baseline: 16 threads read into pinned memory: {:.1} GiB/s",
        total / secs / f64::from(1u32 << 30)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
