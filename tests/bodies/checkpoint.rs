//! Checkpoint files, on either device (feature `safetensors`): a file the format's own
//! serializer wrote loads bit for bit (whole, handed over tensor by tensor with work queued on
//! each at once, and with direct reads) and saves back byte for byte; file ranges go to and from
//! tensors, blocking and pending.

use super::Device;
use cuferry::checkpoint::{self, LoadOptions};
use cuferry::{CudaEngine, PinnedHostBuffer, download_tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A directory for the test's files, removed when dropped.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    pub(crate) fn new(what: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("cuferry-body-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `count` bf16 tensors of `bytes` bytes, distinct bytes per tensor.
pub(crate) fn tensors(count: u8, bytes: usize) -> Vec<(String, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let data = (0..bytes)
                .map(|j| (j as u8).wrapping_mul(31).wrapping_add(i) ^ (j >> 20) as u8)
                .collect();
            (format!("layer.{i:02}.weight"), data)
        })
        .collect()
}

/// Writes `tensors` to `path` with the format's own serializer.
pub(crate) fn write_with_the_formats_serializer(path: &Path, tensors: &[(String, Vec<u8>)]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, b)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::BF16,
                vec![b.len() / 2],
                b,
            );
            (n.clone(), view.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, path).unwrap();
}

pub(crate) fn a_checkpoint_loads_bit_for_bit_and_saves_back_byte_for_byte(dev: Device) {
    let dir = Scratch::new("checkpoint");
    let path = dir.0.join("model.safetensors");
    // 16 bf16 tensors of 16 MiB + 12 bytes: 256 MiB, most tensors off a block boundary (on the
    // simulator, whose device is host memory, 2 MiB + 12 bytes: 32 MiB).
    let each = if dev == Device::Gpu {
        16 << 20
    } else {
        2 << 20
    };
    let tensors = tensors(16, each + 12);
    write_with_the_formats_serializer(&path, &tensors);
    let file = std::fs::read(&path).unwrap();
    let mut engine = dev.engine();
    let check = |engine: &mut CudaEngine, loaded: &checkpoint::Checkpoint, what: &str| {
        for (name, bytes) in &tensors {
            let t = loaded.get(name).unwrap();
            let back = crate::support::any_tensor::any_bytes(engine, t).unwrap();
            assert!(&back == bytes, "{what}: {name}");
        }
    };
    let loaded = checkpoint::load(&mut engine, &path).unwrap();
    check(&mut engine, &loaded, "load");
    for direct in [true, false] {
        let options = LoadOptions::new().direct_io(direct).readers(8);
        let again = checkpoint::load_with(&mut engine, &path, options).unwrap();
        check(
            &mut engine,
            &again,
            if direct { "direct" } else { "8 readers" },
        );
    }
    // Handed over tensor by tensor, each copied on the device at once.
    let mut copies = Vec::new();
    checkpoint::load_each(&mut engine, &path, LoadOptions::new(), |engine, name, t| {
        copies.push((name, crate::support::any_tensor::copy_any(engine, &t)?));
        Ok(())
    })
    .unwrap();
    assert_eq!(copies.len(), tensors.len());
    for (name, copy) in &copies {
        let (_, bytes) = tensors.iter().find(|(n, _)| n == name).unwrap();
        assert!(
            &crate::support::any_tensor::any_bytes(&mut engine, copy).unwrap() == bytes,
            "handoff: {name}"
        );
    }
    drop(copies);
    // Saved back, the file is the serializer's.
    let out = dir.0.join("again.safetensors");
    let named = loaded.named();
    checkpoint::save(&mut engine, &named, &out).unwrap();
    assert!(
        std::fs::read(&out).unwrap() == file,
        "the saved file is the serializer's"
    );
    // File ranges: blocking, then pending.
    let f = std::fs::File::open(&path).unwrap();
    // A range of 40 MiB on a GPU (20 MiB on the simulator) and 3 bytes, across tensors.
    let range_bytes = if dev == Device::Gpu {
        40 << 20
    } else {
        20 << 20
    } + 3;
    let mut range = engine.alloc_tensor::<u8>(&[range_bytes]).unwrap();
    checkpoint::read_into(&mut engine, &path, &f, 1001, &mut range).unwrap();
    let want = &file[1001..1001 + range.len()];
    assert!(download_tensor(&mut engine, &range).unwrap() == want);
    let blob = dir.0.join("blob");
    let w = std::fs::File::create(&blob).unwrap();
    checkpoint::write_from(&mut engine, &range, &blob, &w, 5).unwrap();
    assert!(std::fs::read(&blob).unwrap()[5..] == *want);
    let buffer = PinnedHostBuffer::<u8>::new(&mut engine, range.len()).unwrap();
    let pending = checkpoint::read_pending(&mut engine, &path, &f, 77, buffer, range).unwrap();
    let (buffer, range) = pending.wait().unwrap().into_parts();
    let want = &file[77..77 + range.len()];
    assert!(download_tensor(&mut engine, &range).unwrap() == want);
    let down = cuferry::download_pending(&mut engine, range, buffer).unwrap();
    let returned = down.wait().unwrap();
    checkpoint::write_returned(&blob, &w, 0, &returned).unwrap();
    assert!(std::fs::read(&blob).unwrap()[..returned.buffer().len()] == *want);
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; checkpoint::{
            a_checkpoint_loads_bit_for_bit_and_saves_back_byte_for_byte,
        });
    };
}
pub(crate) use tests;
