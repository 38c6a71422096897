//! Checkpoint files, on either device (feature `safetensors`): a file the format's own
//! serializer wrote loads bit for bit (whole, handed over tensor by tensor with work queued on
//! each at once, and with direct reads) and saves back byte for byte; file ranges go to and from
//! tensors, blocking and pending.

use super::Device;
use cuferry::checkpoint::{self, LoadOptions, Slice, TensorParallel};
use cuferry::error::UsageError;
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

/// A load that converts on the device: f32 to bf16 and f16 (round to nearest even), bf16 and
/// f16 to f32 (exact), on odd element counts; an integer tensor left as it is. Each tensor comes
/// out of `load_with` and of `load_each` with the new type and the host reference's bits (the
/// `half` crate's conversions, which round to nearest even).
pub(crate) fn a_load_converts_element_types_on_the_device(dev: Device) {
    use cuferry::{DType, bf16, f16};
    use safetensors::Dtype as Sd;
    let dir = Scratch::new("convert");
    let path = dir.0.join("model.safetensors");
    let wide: Vec<f32> = (0..1001)
        .map(|i| (i as f32 - 500.0) * 0.012_345_679 + 1.0e-3 / (i as f32 + 1.0))
        .collect();
    let brain: Vec<bf16> = (0..333).map(|i| bf16::from_f32(i as f32 * -0.37)).collect();
    let half_: Vec<f16> = (0..77)
        .map(|i| f16::from_f32(i as f32 * 0.91 - 30.0))
        .collect();
    let ints: Vec<i32> = (0..19).map(|i| i * 7 - 60).collect();
    let bytes = |v: &[u8]| v.to_vec();
    let le = |xs: Vec<[u8; 4]>| xs.concat();
    let files: Vec<(&str, Sd, Vec<usize>, Vec<u8>)> = vec![
        (
            "to_bf16",
            Sd::F32,
            vec![7, 11, 13],
            le(wide.iter().map(|x| x.to_le_bytes()).collect()),
        ),
        (
            "to_f16",
            Sd::F32,
            vec![1001],
            le(wide.iter().map(|x| x.to_le_bytes()).collect()),
        ),
        (
            "from_bf16",
            Sd::BF16,
            vec![333],
            bytes(
                &brain
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect::<Vec<u8>>(),
            ),
        ),
        (
            "from_f16",
            Sd::F16,
            vec![7, 11],
            bytes(
                &half_
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect::<Vec<u8>>(),
            ),
        ),
        (
            "ints",
            Sd::I32,
            vec![19],
            le(ints.iter().map(|x| x.to_le_bytes()).collect()),
        ),
    ];
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = files
        .iter()
        .map(|(n, d, shape, b)| {
            let view = safetensors::tensor::TensorView::new(*d, shape.clone(), b).unwrap();
            (n.to_string(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, &path).unwrap();
    let to = |name: &str, dtype: DType| match name {
        "to_bf16" => DType::BF16,
        "to_f16" => DType::F16,
        "from_bf16" | "from_f16" => DType::F32,
        _ => dtype,
    };
    let mut engine = dev.engine();
    let check = |engine: &mut CudaEngine, name: &str, tensor: &cuferry::AnyTensor| match name {
        "to_bf16" => {
            assert_eq!(tensor.shape(), [7, 11, 13]);
            let got = download_tensor(engine, tensor.as_typed::<bf16>().unwrap()).unwrap();
            let want: Vec<bf16> = wide.iter().map(|&x| bf16::from_f32(x)).collect();
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
        "to_f16" => {
            let got = download_tensor(engine, tensor.as_typed::<f16>().unwrap()).unwrap();
            let want: Vec<f16> = wide.iter().map(|&x| f16::from_f32(x)).collect();
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
        "from_bf16" => {
            let got = download_tensor(engine, tensor.as_typed::<f32>().unwrap()).unwrap();
            assert_eq!(got, brain.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
        }
        "from_f16" => {
            assert_eq!(tensor.shape(), [7, 11]);
            let got = download_tensor(engine, tensor.as_typed::<f32>().unwrap()).unwrap();
            assert_eq!(got, half_.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
        }
        "ints" => {
            let got = download_tensor(engine, tensor.as_typed::<i32>().unwrap()).unwrap();
            assert_eq!(got, ints);
        }
        other => panic!("an unexpected tensor {other}"),
    };
    let loaded = checkpoint::load_with(&mut engine, &path, LoadOptions::new().convert(to)).unwrap();
    assert_eq!(loaded.len(), 5);
    for (name, tensor) in loaded.iter() {
        assert_eq!(tensor.dtype(), to(name, tensor.dtype()), "{name}");
        check(&mut engine, name, tensor);
    }
    drop(loaded);
    let mut seen = 0;
    checkpoint::load_each(
        &mut engine,
        &path,
        LoadOptions::new().convert(to),
        |engine, name, tensor| {
            check(engine, &name, &tensor);
            seen += 1;
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(seen, 5);
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

/// A reader that records the bytes each positioned read returned, by offset, and hands out
/// readers of its own (which record into the same list) when a load asks for one per thread.
pub(crate) struct Counting<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) reads: std::sync::Mutex<Vec<(u64, usize)>>,
    /// Reads through readers `reopen` handed out.
    pub(crate) reads_of_own: std::sync::atomic::AtomicUsize,
}

impl Counting<'_> {
    fn record(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let n = checkpoint::ReadAt::read_at(&self.bytes, buf, offset)?;
        self.reads.lock().unwrap().push((offset, n));
        Ok(n)
    }
}

impl checkpoint::ReadAt for Counting<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        self.record(buf, offset)
    }

    fn reopen(&self) -> Option<Box<dyn checkpoint::ReadAt + '_>> {
        struct Own<'c, 'a>(&'c Counting<'a>);
        impl checkpoint::ReadAt for Own<'_, '_> {
            fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
                (self.0.reads_of_own).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.0.record(buf, offset)
            }
        }
        Some(Box::new(Own(self)))
    }
}

/// The bytes of `slice` of a row-major tensor of `shape` and `elem`-byte elements, cut on the
/// host: the reference a sliced load is checked against.
pub(crate) fn host_slice(data: &[u8], shape: &[usize], elem: usize, slice: &Slice) -> Vec<u8> {
    match slice {
        Slice::Whole => data.to_vec(),
        Slice::Skip => Vec::new(),
        Slice::Rows(r) => {
            let row = data.len().checked_div(shape[0]).unwrap_or(0);
            data[r.start * row..r.end * row].to_vec()
        }
        Slice::Columns(r) => {
            let cols = shape[shape.len() - 1];
            let rows: usize = shape[..shape.len() - 1].iter().product();
            (0..rows)
                .flat_map(|i| {
                    let at = (i * cols + r.start) * elem;
                    data[at..at + r.len() * elem].to_vec()
                })
                .collect()
        }
    }
}

/// The test file of the slicing bodies: odd shapes and odd element counts, every dimension
/// count from a scalar to three, an empty tensor and a `bool` one, written by the format's own
/// serializer; with each tensor's element type, shape and bytes.
pub(crate) fn sliceable(path: &Path) -> Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> {
    use safetensors::Dtype as Sd;
    let make = |n: usize, seed: u8| -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed) ^ (i >> 8) as u8)
            .collect()
    };
    let tensors: Vec<(String, Sd, Vec<usize>, Vec<u8>)> = vec![
        ("a".into(), Sd::F32, vec![37, 53], make(37 * 53 * 4, 1)),
        ("b".into(), Sd::BF16, vec![5, 7, 9], make(5 * 7 * 9 * 2, 2)),
        ("c".into(), Sd::U8, vec![101], make(101, 3)),
        ("d".into(), Sd::F64, vec![3, 1], make(24, 4)),
        ("e".into(), Sd::I16, vec![0, 6], Vec::new()),
        ("s".into(), Sd::F32, vec![], make(4, 5)),
        (
            "mask".into(),
            Sd::BOOL,
            vec![9, 10],
            (0..90).map(|i| (i % 3 == 0) as u8).collect(),
        ),
    ];
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, shape, b)| {
            let view = safetensors::tensor::TensorView::new(*d, shape.clone(), b).unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, path).unwrap();
    tensors
}

/// A load plan, as `LoadOptions::slices` takes one.
type Plan = Box<dyn Fn(&str, &[usize]) -> cuferry::Result<Slice>>;

pub(crate) fn every_slice_kind_reads_only_its_bytes(dev: Device) {
    let dir = Scratch::new("slices");
    let path = dir.0.join("model.safetensors");
    let tensors = sliceable(&path);
    let file = std::fs::read(&path).unwrap();
    let data_start = 8 + u64::from_le_bytes(file[..8].try_into().unwrap());
    let mut engine = dev.engine();
    // Small slots, so a tensor spans several and a slot's read is split between readers.
    let mut config = engine.staging_config();
    config.chunk_bytes = 4096;
    config.cutoff_bytes = 4096;
    engine.set_staging_config(config).unwrap();
    // Tensor-parallel plans for worlds of 1, 2, 3 and 8 (uneven splits allowed: 37 rows, 53
    // columns), and plans of hand-picked ranges, empty ones included.
    let mut plans: Vec<Plan> = Vec::new();
    for world in [1usize, 2, 3, 8] {
        for rank in 0..world {
            let plan = TensorParallel::new(rank, world)
                .unwrap()
                .rows("a")
                .rows("mask")
                .columns("b")
                .columns("c")
                .columns("d")
                .rows("e")
                .columns("s")
                .uneven(true);
            plans.push(Box::new(move |n, shape| plan.slice(n, shape)));
        }
    }
    plans.push(Box::new(|n, _| {
        Ok(match n {
            "a" => Slice::Columns(17..18),
            "b" => Slice::Rows(4..5),
            "c" => Slice::Skip,
            "d" => Slice::Columns(0..1),
            "e" => Slice::Columns(2..5),
            "mask" => Slice::Columns(3..3),
            _ => Slice::Whole,
        })
    }));
    plans.push(Box::new(|n, _| {
        Ok(match n {
            "a" => Slice::Rows(0..0),
            "b" => Slice::Columns(1..8),
            "mask" => Slice::Columns(9..10),
            _ => Slice::Skip,
        })
    }));
    for (p, plan) in plans.iter().enumerate() {
        let reader = Counting {
            bytes: &file,
            reads: std::sync::Mutex::new(Vec::new()),
            reads_of_own: Default::default(),
        };
        let options = LoadOptions::new()
            .readers(3)
            .slices(|n: &str, shape: &[usize]| plan(n, shape));
        let mut loaded =
            checkpoint::load_from(&mut engine, &path, &reader, file.len() as u64, options).unwrap();
        let mut want_bytes = 0;
        for (name, dtype, shape, data) in &tensors {
            let slice = plan(name, shape).unwrap();
            let Some(tensor) = loaded.remove(name) else {
                assert_eq!(slice, Slice::Skip, "plan {p}: {name} is missing");
                continue;
            };
            let want = host_slice(data, shape, dtype.bitsize() / 8, &slice);
            want_bytes += want.len();
            let mut want_shape = shape.clone();
            match &slice {
                Slice::Rows(r) => want_shape[0] = r.len(),
                Slice::Columns(r) => *want_shape.last_mut().unwrap() = r.len(),
                _ => {}
            }
            assert_eq!(tensor.shape(), want_shape, "plan {p}: {name}");
            let got = crate::support::any_tensor::any_bytes(&mut engine, &tensor).unwrap();
            assert!(got == want, "plan {p}: {name} {slice:?}");
        }
        assert!(loaded.is_empty());
        // The data the load read: the slices' bytes, and the one byte of the probe at the end
        // that tells a file that changed length during the load.
        let read: usize = reader
            .reads
            .lock()
            .unwrap()
            .iter()
            .filter(|(at, _)| *at >= data_start)
            .map(|(_, n)| n)
            .sum();
        assert_eq!(read, want_bytes + 1, "plan {p}");
        // The runs of a slice of columns (a part of each of several rows) are read through
        // readers of the threads' own.
        let columns = tensors.iter().any(|(name, _, shape, _)| {
            let rows: usize = shape.iter().rev().skip(1).product();
            matches!(plan(name, shape).unwrap(), Slice::Columns(r)
                if !r.is_empty() && r.len() < shape[shape.len() - 1] && rows > 1)
        });
        let own = reader.reads_of_own.into_inner();
        assert_eq!(
            own > 0,
            columns,
            "plan {p}: {own} reads of the threads' own"
        );
    }
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

pub(crate) fn a_slice_that_does_not_fit_is_refused_before_anything_is_allocated(dev: Device) {
    let dir = Scratch::new("bad-slices");
    let path = dir.0.join("model.safetensors");
    sliceable(&path);
    let mut engine = dev.engine();
    let allocations = |engine: &CudaEngine| {
        engine
            .sim()
            .map(|sim| sim.calls(cuferry::sim::SimOp::Alloc))
    };
    let before = allocations(&engine);
    // 37 rows between 2 ranks.
    let plan = TensorParallel::new(1, 2).unwrap().rows("a");
    let err = checkpoint::load_with(&mut engine, &path, LoadOptions::new().tensor_parallel(plan))
        .unwrap_err();
    assert!(
        matches!(
            err,
            cuferry::Error::Usage(UsageError::UnevenSplit {
                ref tensor,
                dimension: 0,
                size: 37,
                world: 2
            }) if tensor == "a"
        ),
        "{err:?}"
    );
    let bad = [
        ("a", Slice::Rows(30..38)),
        ("b", Slice::Columns(0..10)),
        ("s", Slice::Rows(0..1)),
        #[allow(clippy::reversed_empty_ranges)]
        ("c", Slice::Columns(5..4)),
    ];
    for (name, slice) in bad {
        let options = LoadOptions::new().slices(|n, _| {
            Ok(if n == name {
                slice.clone()
            } else {
                Slice::Whole
            })
        });
        let err = checkpoint::load_with(&mut engine, &path, options).unwrap_err();
        let (what, range) = match slice {
            Slice::Rows(r) => ("rows", r),
            Slice::Columns(r) => ("columns", r),
            _ => unreachable!(),
        };
        assert!(
            matches!(
                err,
                cuferry::Error::Usage(UsageError::SliceOutOfRange { ref tensor, what: w, range: ref r, .. })
                    if tensor == name && w == what && *r == range
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains(name), "{err}");
    }
    // A plan's own error stops the load as it is.
    let options = LoadOptions::new().slices(|n, _| {
        Err(UsageError::NoTensor {
            tensor: n.to_owned(),
        }
        .into())
    });
    assert!(matches!(
        checkpoint::load_with(&mut engine, &path, options).unwrap_err(),
        cuferry::Error::Usage(UsageError::NoTensor { .. })
    ));
    assert_eq!(allocations(&engine), before);
    engine.synchronize().unwrap();
    Device::no_violations(&engine);
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; checkpoint::{
            a_checkpoint_loads_bit_for_bit_and_saves_back_byte_for_byte,
            a_load_converts_element_types_on_the_device,
            every_slice_kind_reads_only_its_bytes,
            a_slice_that_does_not_fit_is_refused_before_anything_is_allocated,
        });
    };
}
pub(crate) use tests;
