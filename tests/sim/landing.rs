//! A load of a file of small tensors lands its data on the device while its header is parsed:
//! the reads start before the header is known, the file is read once into one allocation, each
//! tensor is aligned to its element, a file the landing cannot serve loads the usual way, a bad
//! header found after the landing frees it, and a fault, a panic or a refusal at any step loses
//! nothing.

use cuferry::AnyTensor;
use cuferry::checkpoint::{self, LoadOptions, ReadAt};
use cuferry::sim::{SimConfig, SimDevice, SimOp};
use cuferry::{CudaEngine, DType, Error, bf16};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// What a load must give back of a tensor: its name, element type and bytes.
type Expected = (String, DType, Vec<u8>);

/// A tensor to write: its name, element type, element count and bytes.
type Written = (String, safetensors::Dtype, usize, Vec<u8>);

/// `(name, element type, bytes)` of `count` small tensors of four element types (no `bool`),
/// 1 to about 3,000 bytes each, and the file the format's serializer writes of them.
fn small(count: usize) -> (Vec<u8>, Vec<Expected>) {
    use safetensors::Dtype as Sd;
    let tensors: Vec<Written> = (0..count)
        .map(|i| {
            let (dtype, elem) = [(Sd::U8, 1), (Sd::F32, 4), (Sd::BF16, 2), (Sd::F64, 8)][i % 4];
            let n = 1 + (i * 37) % (3000 / elem);
            let data = (0..n * elem).map(|j| (j * 7 + i * 13) as u8).collect();
            (format!("block.{i:03}.norm"), dtype, n, data)
        })
        .collect();
    write(&tensors)
}

/// The file the format's serializer writes of `tensors` (name, type, elements, bytes), and what
/// a load must give back of each.
fn write(tensors: &[Written]) -> (Vec<u8>, Vec<Expected>) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, n, data)| {
            let view = safetensors::tensor::TensorView::new(*dtype, vec![*n], data).unwrap();
            (name.clone(), view)
        })
        .collect();
    let file = safetensors::serialize(views, None::<HashMap<String, String>>).unwrap();
    let expected = tensors
        .iter()
        .map(|(name, dtype, _, data)| {
            let dtype = match dtype {
                safetensors::Dtype::U8 => DType::U8,
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                safetensors::Dtype::F64 => DType::F64,
                safetensors::Dtype::BOOL => DType::Bool,
                other => panic!("{other:?}"),
            };
            (name.clone(), dtype, data.clone())
        })
        .collect();
    (file, expected)
}

/// The file of `count` small tensors of `dtype`, `n` elements each (tensor `i`'s bytes all
/// `i`), then `last`, and what a load must give back.
fn among(
    count: usize,
    dtype: safetensors::Dtype,
    n: usize,
    last: Written,
) -> (Vec<u8>, Vec<Expected>) {
    let size = match dtype {
        safetensors::Dtype::F32 => 4,
        _ => 1,
    };
    let mut tensors: Vec<Written> = (0..count)
        .map(|i| (format!("n{i:03}"), dtype, n, vec![i as u8; n * size]))
        .collect();
    tensors.push(last);
    write(&tensors)
}

/// A simulated engine whose staging slots are `chunk` bytes, and its device.
fn engine_with(chunk: usize) -> (CudaEngine, SimDevice) {
    let sim = SimDevice::new(SimConfig::default());
    (engine_on(&sim, chunk), sim)
}

/// An engine on `sim` whose staging slots are `chunk` bytes.
fn engine_on(sim: &SimDevice, chunk: usize) -> CudaEngine {
    let mut engine = CudaEngine::simulated_on(sim);
    let mut config = cuferry::staging::StagingConfig::default();
    config.chunk_bytes = chunk;
    config.cutoff_bytes = 1024;
    engine.set_staging_config(config).unwrap();
    engine
}

/// Loads `file` through `reader` with three readers.
fn load(
    engine: &mut CudaEngine,
    reader: &dyn ReadAt,
    len: usize,
) -> Result<checkpoint::Checkpoint, Error> {
    let options = LoadOptions::new().readers(3);
    checkpoint::load_from(
        engine,
        Path::new("small.safetensors"),
        reader,
        len as u64,
        options,
    )
}

/// The device address of a tensor of one of the element types above.
fn address(tensor: &AnyTensor) -> u64 {
    match tensor.dtype() {
        DType::U8 => tensor.as_typed::<u8>().unwrap().sim_address(),
        DType::F32 => tensor.as_typed::<f32>().unwrap().sim_address(),
        DType::BF16 => tensor.as_typed::<bf16>().unwrap().sim_address(),
        DType::F64 => tensor.as_typed::<f64>().unwrap().sim_address(),
        DType::Bool => tensor.as_typed::<bool>().unwrap().sim_address(),
        other => panic!("{other:?}"),
    }
}

/// Checks that `loaded` holds `expected`, bit for bit, each tensor aligned to its element.
fn holds(engine: &mut CudaEngine, loaded: &checkpoint::Checkpoint, expected: &[Expected]) {
    assert_eq!(loaded.len(), expected.len());
    for (name, dtype, data) in expected {
        let tensor = loaded
            .get(name)
            .unwrap_or_else(|| panic!("{name} is missing"));
        assert_eq!(tensor.dtype(), *dtype, "{name}");
        let at = address(tensor);
        assert!(
            at.is_multiple_of(dtype.size_bytes() as u64),
            "{name} at {at:#x}"
        );
        let back = crate::support::any_tensor::any_bytes(engine, tensor).unwrap();
        assert!(back == *data, "{name}: the bytes differ");
    }
}

/// A reader that counts the bytes it reads, and whose read of the header's text (at byte 8)
/// waits until a read of the data (at `data` or later) has begun, or gives up after two
/// seconds and says so (`missed`).
struct Watch<'a> {
    bytes: &'a [u8],
    data: u64,
    read: AtomicU64,
    data_begun: Mutex<bool>,
    begun: Condvar,
    missed: AtomicBool,
}

impl<'a> Watch<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        Watch {
            bytes,
            data: 8 + header,
            read: AtomicU64::new(0),
            data_begun: Mutex::new(false),
            begun: Condvar::new(),
            missed: AtomicBool::new(false),
        }
    }
}

impl ReadAt for Watch<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        if offset >= self.data {
            *self.data_begun.lock().unwrap() = true;
            self.begun.notify_all();
        } else if offset == 8 {
            let begun = self.data_begun.lock().unwrap();
            let (begun, _) = self
                .begun
                .wait_timeout_while(begun, Duration::from_secs(2), |begun| !*begun)
                .unwrap();
            if !*begun {
                self.missed.store(true, Ordering::SeqCst);
            }
        }
        let n = self.bytes.read_at(buf, offset)?;
        self.read.fetch_add(n as u64, Ordering::SeqCst);
        Ok(n)
    }
}

#[test]
fn a_file_of_small_tensors_is_read_while_its_header_is_parsed() {
    let (file, expected) = small(300);
    let (mut engine, sim) = engine_with(64 << 10);
    let reader = Watch::new(&file);
    let loaded = load(&mut engine, &reader, file.len()).unwrap();
    assert!(
        !reader.missed.load(Ordering::SeqCst),
        "the header's text was read before any of the data"
    );
    holds(&mut engine, &loaded, &expected);
    drop(loaded);
    drop(engine);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0, "device memory left");
}

#[test]
fn a_landed_file_is_read_once_into_one_allocation() {
    // About 300 KiB of data through 64 KiB slots: more than one slot, fewer than sixteen.
    let (file, expected) = small(300);
    assert!(file.len() > 4 * (64 << 10));
    let (mut engine, sim) = engine_with(64 << 10);
    let allocations = sim.calls(SimOp::Alloc);
    let reader = Watch::new(&file);
    let loaded = load(&mut engine, &reader, file.len()).unwrap();
    assert_eq!(
        sim.calls(SimOp::Alloc) - allocations,
        1,
        "one allocation holds every tensor"
    );
    // The prefix twice (the landing's look and the header's read), the header and the data
    // once each, and the probe of the file's last byte (the probe past it reads nothing).
    assert_eq!(
        reader.read.load(Ordering::SeqCst),
        file.len() as u64 + 8 + 1
    );
    holds(&mut engine, &loaded, &expected);
}

#[test]
fn a_file_the_landing_cannot_serve_loads_from_its_header_read_again() {
    use safetensors::Dtype as Sd;
    // A `bool` tensor among small ones: its bytes are checked on the host, so the file is read
    // again the usual way.
    let mask = (0..30).map(|j| (j % 2) as u8).collect();
    let (file, expected) = among(40, Sd::F32, 50, ("mask".into(), Sd::BOOL, 30, mask));
    let (mut engine, sim) = engine_with(64 << 10);
    let reader = Watch::new(&file);
    let loaded = load(&mut engine, &reader, file.len()).unwrap();
    let header = 8 + u64::from_le_bytes(file[..8].try_into().unwrap());
    let data = file.len() as u64 - header;
    assert!(
        reader.read.load(Ordering::SeqCst) > file.len() as u64 + data - 1,
        "the data was read twice"
    );
    holds(&mut engine, &loaded, &expected);
    drop(loaded);
    // A byte other than 0 or 1 in it is refused, naming it, and nothing is left.
    let mut bad = file.clone();
    let at = bad.len() - 7;
    bad[at] = 2;
    let err = load(&mut engine, &&bad[..], bad.len()).unwrap_err();
    assert!(err.to_string().contains("'mask'"), "{err}");
    engine.synchronize().unwrap();
    assert_eq!(sim.device_live().0, 0, "device memory left");

    // A tensor whose offset in the data is not a multiple of its element's size (a writer
    // other than the format's): landed, it would sit misaligned; loaded the usual way, it is
    // aligned.
    let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}}"#;
    let mut odd = (json.len() as u64).to_le_bytes().to_vec();
    odd.extend_from_slice(json.as_bytes());
    odd.extend([9u8, 1, 2, 3, 4, 5, 6, 7, 8]);
    let loaded = load(&mut engine, &&odd[..], odd.len()).unwrap();
    let expected = [
        ("a".to_string(), DType::U8, vec![9u8]),
        ("b".to_string(), DType::F32, vec![1, 2, 3, 4, 5, 6, 7, 8]),
    ];
    holds(&mut engine, &loaded, &expected);
    drop(loaded);
    drop(engine);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(sim.device_live().0, 0, "device memory left");
}

#[test]
fn a_file_with_a_large_tensor_is_not_landed_and_is_read_once() {
    use safetensors::Dtype as Sd;
    // One tensor of 4 MiB and three small ones: a header this short names too few tensors for
    // data this long to be small tensors only, so the file is planned first and read once.
    let tensors: Vec<Written> = [("big", 4usize << 20), ("a", 64), ("b", 64), ("c", 64)]
        .into_iter()
        .map(|(name, n)| {
            (
                name.to_string(),
                Sd::U8,
                n,
                (0..n).map(|j| (j % 251) as u8).collect(),
            )
        })
        .collect();
    let (file, expected) = write(&tensors);
    let (mut engine, _sim) = engine_with(16 << 20);
    let reader = Watch::new(&file);
    let loaded = load(&mut engine, &reader, file.len()).unwrap();
    assert!(
        reader.read.load(Ordering::SeqCst) < file.len() as u64 + 64,
        "{} bytes read of {}",
        reader.read.load(Ordering::SeqCst),
        file.len()
    );
    holds(&mut engine, &loaded, &expected);
}

#[test]
fn a_bad_header_found_after_the_landing_is_reported_and_frees_it() {
    // Each a valid prefix and data long enough to land, behind a header that is wrong: not
    // JSON, a gap between two ranges, data longer than the ranges say.
    let entries: String = (0..200)
        .map(|i| {
            format!(
                r#""t{i:03}":{{"dtype":"U8","shape":[100],"data_offsets":[{},{}]}}"#,
                i * 100,
                i * 100 + 100
            )
        })
        .collect::<Vec<_>>()
        .join(",");
    let gap = entries.replace("[500,600]", "[501,600]").replace(
        r#""shape":[100],"data_offsets":[501"#,
        r#""shape":[99],"data_offsets":[501"#,
    );
    let headers = [
        (format!("{{{entries}"), 20_000, "not JSON"),
        (format!("{{{gap}}}"), 20_000, "does not start where"),
        (format!("{{{entries}}}"), 20_001, "data"),
    ];
    for (json, data, says) in headers {
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        file.extend(std::iter::repeat_n(1u8, data));
        let (mut engine, sim) = engine_with(64 << 10);
        let err = load(&mut engine, &&file[..], file.len()).unwrap_err();
        assert!(matches!(err, Error::Malformed(_)), "{err:?}");
        assert!(err.to_string().contains(says), "{says}: {err}");
        engine.synchronize().unwrap();
        assert_eq!(sim.device_live().0, 0, "{says}: device memory left");
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }
}

/// After a failed load: nothing freed under a copy, and the engine lands the file right.
fn recovers(mut engine: CudaEngine, sim: &SimDevice, file: &[u8], expected: &[Expected]) {
    let _ = engine.synchronize();
    sim.clear_faults();
    let loaded = load(&mut engine, &file, file.len()).expect("the engine loads again");
    holds(&mut engine, &loaded, expected);
    drop(loaded);
    let retained = engine.retirement_stats().retained;
    drop(engine);
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    if retained == 0 {
        assert_eq!(sim.device_live().0, 0, "device memory left");
        assert_eq!(sim.pinned_live().0, 0, "pinned memory left");
    }
}

#[test]
fn a_fault_at_every_driver_call_of_a_landing_is_reported_and_loses_nothing() {
    let (file, expected) = small(120);
    const OPS: [SimOp; 6] = [
        SimOp::Alloc,
        SimOp::HostAlloc,
        SimOp::CopyHtoD,
        SimOp::EventCreate,
        SimOp::EventRecord,
        SimOp::EventSynchronize,
    ];
    let counts: Vec<u64> = {
        let (mut engine, sim) = engine_with(16 << 10);
        let before: Vec<u64> = OPS.iter().map(|&op| sim.calls(op)).collect();
        drop(load(&mut engine, &&file[..], file.len()).unwrap());
        OPS.iter()
            .zip(before)
            .map(|(&op, b)| sim.calls(op) - b)
            .collect()
    };
    let mut runs = 0;
    for (&op, &count) in OPS.iter().zip(&counts) {
        for n in 1..=count {
            let (mut engine, sim) = engine_with(16 << 10);
            sim.fail_nth(op, n, cuferry::error::DriverError::LAUNCH_FAILED);
            match load(&mut engine, &&file[..], file.len()) {
                Err(e) if !matches!(e, Error::Io(_) | Error::Malformed(_)) => {}
                // A slot after the first cannot be made: the load goes on with those it has.
                Ok(loaded) if op == SimOp::HostAlloc && n > 1 => {
                    holds(&mut engine, &loaded, &expected);
                }
                other => panic!("{op:?} call {n}: {other:?}"),
            }
            recovers(engine, &sim, &file, &expected);
            runs += 1;
        }
    }
    assert!(runs > 20, "{runs} runs");
}

/// A reader that panics at its `n`-th read.
struct Panicking<'a> {
    bytes: &'a [u8],
    panic_at: usize,
    reads: AtomicUsize,
}

impl ReadAt for Panicking<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        if self.reads.fetch_add(1, Ordering::SeqCst) + 1 == self.panic_at {
            panic!("injected reader panic");
        }
        self.bytes.read_at(buf, offset)
    }
}

#[test]
fn a_reader_that_panics_at_any_read_of_a_landing_frees_nothing_under_a_copy() {
    let (file, expected) = small(120);
    for panic_at in 1.. {
        let (mut engine, sim) = engine_with(16 << 10);
        let reader = Panicking {
            bytes: &file,
            panic_at,
            reads: AtomicUsize::new(0),
        };
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            load(&mut engine, &reader, file.len())
        }));
        if let Ok(loaded) = loaded {
            assert!(
                panic_at > 10,
                "read {panic_at}: the panic did not reach the caller"
            );
            holds(&mut engine, &loaded.unwrap(), &expected);
            recovers(engine, &sim, &file, &expected);
            break;
        }
        recovers(engine, &sim, &file, &expected);
    }
}

#[test]
fn a_landing_stopped_at_any_tensor_keeps_those_handed_out_and_frees_the_rest_after_its_copies() {
    stopped_at(40, 16 << 10, 1..=40);
    // Across the batches the header's thread makes (256 tensors each): in the first, at the
    // first of the second, while the second is being made, at the last.
    stopped_at(600, 128 << 10, [1, 255, 256, 257, 300, 511, 512, 513, 600]);
}

/// Lands a file of `count` small tensors through slots of `chunk` bytes, stopping (the
/// callback refusing) at each tensor of `stops` in turn: those handed out hold the file's
/// bytes, and nothing else is kept.
fn stopped_at(count: usize, chunk: usize, stops: impl IntoIterator<Item = usize>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.safetensors");
    let (file, expected) = small(count);
    std::fs::write(&path, &file).unwrap();
    assert!(file.len() < 16 * chunk, "a file to land");
    for stop in stops {
        let (mut engine, sim) = engine_with(chunk);
        let mut kept = Vec::new();
        let stopped =
            checkpoint::load_each(&mut engine, &path, LoadOptions::new(), |_, name, tensor| {
                if kept.len() + 1 == stop {
                    return Err(Error::Usage(cuferry::error::UsageError::ZeroLength {
                        what: "the caller's refusal",
                    }));
                }
                kept.push((name, tensor));
                Ok(())
            });
        assert!(
            matches!(stopped, Err(Error::Usage(_))),
            "{stop}: {stopped:?}"
        );
        for (name, tensor) in &kept {
            let (_, _, data) = expected.iter().find(|(n, _, _)| n == name).unwrap();
            let back = crate::support::any_tensor::any_bytes(&mut engine, tensor).unwrap();
            assert!(back == *data, "{stop}: {name}");
        }
        drop(kept);
        engine.synchronize().unwrap();
        assert_eq!(sim.device_live().0, 0, "{stop}: device memory left");
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }
}

#[test]
fn progress_of_a_landing_counts_the_data_once() {
    let (file, _) = small(120);
    let header = 8 + u64::from_le_bytes(file[..8].try_into().unwrap());
    let (mut engine, _sim) = engine_with(16 << 10);
    let mut steps = Vec::new();
    let options = LoadOptions::new().progress(|p| steps.push(p));
    drop(
        checkpoint::load_from(
            &mut engine,
            Path::new("small.safetensors"),
            &&file[..],
            file.len() as u64,
            options,
        )
        .unwrap(),
    );
    let total = file.len() as u64 - header;
    assert!(steps.len() > 1, "{steps:?}");
    assert!(steps.windows(2).all(|w| w[0].done < w[1].done), "{steps:?}");
    assert!(steps.iter().all(|p| p.total == total), "{steps:?}");
    assert_eq!(steps.last().unwrap().done, total);
}

/// A reader whose reads of the data (at `data` or later) each take 20 ms, counting the bytes it
/// reads.
struct Slow<'a> {
    bytes: &'a [u8],
    data: u64,
    read: AtomicU64,
}

impl ReadAt for Slow<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        if offset >= self.data {
            std::thread::sleep(Duration::from_millis(20));
        }
        let n = self.bytes.read_at(buf, offset)?;
        self.read.fetch_add(n as u64, Ordering::SeqCst);
        Ok(n)
    }
}

#[test]
fn a_landing_stops_reading_once_the_header_names_a_large_tensor() {
    use safetensors::Dtype as Sd;
    // 200 small tensors and one of 512 KiB: a header this long could name small tensors only,
    // so the data starts landing; once the header is parsed, the large tensor stops it, and the
    // file is read the usual way.
    let big = (0..512 << 10).map(|j| (j % 253) as u8).collect();
    let (file, expected) = among(200, Sd::U8, 100, ("big".into(), Sd::U8, 512 << 10, big));
    let data_start = 8 + u64::from_le_bytes(file[..8].try_into().unwrap());
    let data = file.len() as u64 - data_start;
    let (mut engine, _sim) = engine_with(64 << 10);
    let reader = Slow {
        bytes: &file,
        data: data_start,
        read: AtomicU64::new(0),
    };
    let loaded = load(&mut engine, &reader, file.len()).unwrap();
    let read = reader.read.load(Ordering::SeqCst);
    assert!(
        read < file.len() as u64 + data / 2,
        "{read} bytes read of a file of {}",
        file.len()
    );
    holds(&mut engine, &loaded, &expected);
}

#[test]
fn work_queued_on_a_landed_tensor_as_it_is_handed_over_follows_its_copies() {
    // Each tensor is handed over once every copy into the data is queued, before they are
    // proven; a copy of it queued at once on the compute stream must still see the file's
    // bytes, whatever order the device runs its streams in.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.safetensors");
    // More tensors than the header's thread makes in one batch: the later batches are
    // recorded as the first is.
    let (file, expected) = small(300);
    assert!(file.len() < 16 * (64 << 10), "a file to land");
    std::fs::write(&path, &file).unwrap();
    for seed in 0..16 {
        let sim = SimDevice::new(SimConfig::default());
        sim.set_schedule(cuferry::sim::Schedule::Interleaved { seed });
        let mut engine = engine_on(&sim, 64 << 10);
        let mut copies = Vec::new();
        let mut handed = 0;
        checkpoint::load_each(
            &mut engine,
            &path,
            LoadOptions::new(),
            |engine, name, tensor| {
                handed += 1;
                // From seed 8 on, the first work queued is on a tensor of the second batch.
                if seed >= 8 && handed <= 256 {
                    copies.push((name, tensor));
                    return Ok(());
                }
                let copy = crate::support::any_tensor::copy_any(engine, &tensor)?;
                // Odd seeds drop the tensor at once, while its copies may still run.
                if seed % 2 == 0 {
                    copies.push((name.clone(), tensor));
                }
                copies.push((name, copy));
                Ok(())
            },
        )
        .unwrap();
        for (name, tensor) in &copies {
            let (_, _, data) = expected.iter().find(|(n, _, _)| n == name).unwrap();
            let back = crate::support::any_tensor::any_bytes(&mut engine, tensor).unwrap();
            assert!(back == *data, "seed {seed}: {name}");
        }
        drop(copies);
        drop(engine);
        assert!(
            sim.violations().is_empty(),
            "seed {seed}: {:?}",
            sim.violations()
        );
        assert_eq!(sim.device_live().0, 0, "seed {seed}: device memory left");
    }
}
