//! Checkpoint files through the public API on the simulated device: a file the format's own
//! serializer wrote loads bit for bit, typed; a save of those tensors is the same file; a
//! selection reads only what it selects; a bad file is a typed error naming it, and the engine
//! works on.

use cuferry::AnyTensor;
use cuferry::checkpoint::{self, LoadOptions, Progress, SaveOptions, SaveTensor};
use cuferry::error::{IoError, MalformedError, UsageError};
use cuferry::sim::SimConfig;
use cuferry::{CudaEngine, Error, bf16, download_tensor, upload_tensor};
use std::collections::HashMap;

// Written once in `tests/bodies/checkpoint.rs`, run here on the simulated device and by the GPU
// suite on device 0.
crate::bodies::checkpoint::tests!(sim);

/// `(name, dtype, shape, bytes)` of a small model, written by the format's serializer.
fn model() -> Vec<u8> {
    use safetensors::Dtype;
    let weights: Vec<u8> = (0..32u32 * 24)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    let bias: Vec<u8> = (0..24u16)
        .flat_map(|i| bf16::from_f32(f32::from(i)).to_le_bytes())
        .collect();
    let steps = 7u64.to_le_bytes();
    let views = vec![
        (
            "layer.weight",
            safetensors::tensor::TensorView::new(Dtype::F32, vec![32, 24], &weights).unwrap(),
        ),
        (
            "layer.bias",
            safetensors::tensor::TensorView::new(Dtype::BF16, vec![24], &bias).unwrap(),
        ),
        (
            "steps",
            safetensors::tensor::TensorView::new(Dtype::U64, vec![1], &steps).unwrap(),
        ),
    ];
    safetensors::serialize(views, None::<HashMap<String, String>>).unwrap()
}

#[test]
fn a_file_the_format_wrote_loads_typed_and_saves_back_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, model()).unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut loaded = checkpoint::load(&mut engine, &path).unwrap();
    assert_eq!(loaded.len(), 3);
    let weight = loaded.remove("layer.weight").unwrap();
    assert_eq!(weight.shape(), [32, 24]);
    let weight = weight.into_typed::<f32>().unwrap();
    let host = download_tensor(&mut engine, &weight).unwrap();
    assert_eq!(host[5], 2.5);
    assert!(
        loaded.remove("steps").unwrap().into_typed::<u32>().is_err(),
        "u64, not u32"
    );
    // Saved again (the typed tensor converted back), the file is the serializer's, byte for byte.
    let bias = loaded.get("layer.bias").unwrap();
    let weight = AnyTensor::from(weight);
    let again = dir.path().join("again.safetensors");
    let steps = AnyTensor::from(upload_tensor(&mut engine, &[7u64], &[1]).unwrap());
    checkpoint::save(
        &mut engine,
        &[
            ("steps", &steps),
            ("layer.weight", &weight),
            ("layer.bias", bias),
        ],
        &again,
    )
    .unwrap();
    assert_eq!(std::fs::read(&again).unwrap(), model());
}

#[test]
fn a_checkpoint_keeps_file_order_whatever_order_its_tensors_come_in() {
    use safetensors::Dtype;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("order.safetensors");
    // "a" and "b" hold bytes; "c" holds none, lies last in the file, and is handed over first.
    let (a, b) = (vec![1u8; 64], vec![2u8; 32]);
    fn view(data: &[u8]) -> safetensors::tensor::TensorView<'_> {
        safetensors::tensor::TensorView::new(Dtype::U8, vec![data.len()], data).unwrap()
    }
    let views = vec![("a", view(&a)), ("b", view(&b)), ("c", view(&[]))];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut came = Vec::new();
    checkpoint::load_each(&mut engine, &path, LoadOptions::new(), |_, name, _| {
        came.push(name);
        Ok(())
    })
    .unwrap();
    assert_eq!(came.first().map(String::as_str), Some("c"), "{came:?}");
    let loaded = checkpoint::load(&mut engine, &path).unwrap();
    assert_eq!(loaded.names().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(loaded.len(), 3);
    assert_eq!(loaded.get("c").unwrap().len(), 0);
}

#[test]
fn a_selection_loads_only_what_it_names() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, model()).unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let loaded = checkpoint::load_with(
        &mut engine,
        &path,
        LoadOptions::new().select(|name| name.ends_with("bias")),
    )
    .unwrap();
    assert_eq!(loaded.names().collect::<Vec<_>>(), ["layer.bias"]);
}

#[test]
fn a_bad_file_is_a_typed_error_naming_it_and_the_engine_works_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.safetensors");
    let mut bytes = model();
    bytes.truncate(bytes.len() - 3);
    std::fs::write(&path, &bytes).unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let err = checkpoint::load(&mut engine, &path).unwrap_err();
    assert!(
        matches!(err, Error::Malformed(MalformedError::DataLength { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("broken.safetensors"), "{err}");
    let missing = checkpoint::load(&mut engine, dir.path().join("absent")).unwrap_err();
    assert!(
        matches!(
            missing,
            Error::Io(IoError::File {
                operation: "open",
                ..
            })
        ),
        "{missing}"
    );
    let t = upload_tensor(&mut engine, &[1u8, 2, 3], &[3]).unwrap();
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), [1, 2, 3]);
}

/// The progress of a load and of a save: monotone, and ending at the total, which is the bytes
/// selected (or written).
#[test]
fn progress_climbs_to_the_total_of_the_bytes_moved() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, model()).unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut seen: Vec<Progress> = Vec::new();
    let loaded = checkpoint::load_with(
        &mut engine,
        &path,
        LoadOptions::new()
            .select(|n| n != "steps")
            .progress(|p| seen.push(p)),
    )
    .unwrap();
    let total = 32 * 24 * 4 + 24 * 2;
    assert!(seen.windows(2).all(|w| w[0].done < w[1].done), "{seen:?}");
    assert_eq!(seen.last(), Some(&Progress { done: total, total }));
    let mut saved: Vec<Progress> = Vec::new();
    let named = loaded.named();
    let out = dir.path().join("out.safetensors");
    checkpoint::save_with(
        &mut engine,
        &named,
        &out,
        SaveOptions::new().progress(|p| saved.push(p)),
    )
    .unwrap();
    assert_eq!(saved.last(), Some(&Progress { done: total, total }));
}

/// A sharded checkpoint: the index's weight map places each tensor in a shard beside it; a
/// missing shard, or a shard without a tensor the index places there, is a typed error.
#[test]
fn a_sharded_checkpoint_loads_through_its_index() {
    use safetensors::Dtype;
    let dir = tempfile::tempdir().unwrap();
    let a: Vec<u8> = (0..64u8).collect();
    let b: Vec<u8> = (64..96u8).collect();
    let shard = |name: &str, tensor: &str, data: &[u8]| {
        let view = safetensors::tensor::TensorView::new(Dtype::U8, vec![data.len()], data).unwrap();
        let bytes =
            safetensors::serialize(vec![(tensor, view)], None::<HashMap<String, String>>).unwrap();
        std::fs::write(dir.path().join(name), bytes).unwrap();
    };
    shard("model-00001-of-00002.safetensors", "a", &a);
    shard("model-00002-of-00002.safetensors", "b", &b);
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"metadata": {"total_size": 96}, "weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let loaded = checkpoint::load(&mut engine, &index).unwrap();
    assert_eq!(loaded.names().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(
        crate::support::any_tensor::any_bytes(&mut engine, loaded.get("b").unwrap()).unwrap(),
        b
    );
    // A shard that is not there.
    std::fs::write(
        &index,
        r#"{"weight_map": {"a": "model-00003-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let err = checkpoint::load(&mut engine, &index).unwrap_err();
    assert!(
        matches!(err, Error::Malformed(MalformedError::MissingShard { .. })),
        "{err}"
    );
    // A shard without the tensor the index places there.
    std::fs::write(
        &index,
        r#"{"weight_map": {"b": "model-00001-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let err = checkpoint::load(&mut engine, &index).unwrap_err();
    assert!(
        err.to_string().contains("'b'") && err.to_string().contains("lacks"),
        "{err}"
    );
    // A name given twice.
    std::fs::write(
        &index,
        r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "a": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let err = checkpoint::load(&mut engine, &index).unwrap_err();
    assert!(err.to_string().contains("twice"), "{err}");
}

/// An engine whose staging slots are `chunk` bytes, so a small file takes many chunks.
fn small_slots(chunk: usize) -> CudaEngine {
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut config = cuferry::staging::StagingConfig::default();
    config.chunk_bytes = chunk;
    config.cutoff_bytes = 1024;
    engine.set_staging_config(config).unwrap();
    engine
}

/// A file of `count` u8 tensors of `bytes` bytes each (distinct contents), and their bytes.
fn layers(count: usize, bytes: usize) -> (Vec<u8>, Vec<(String, Vec<u8>)>) {
    let tensors: Vec<(String, Vec<u8>)> = (0..count)
        .map(|i| {
            let data = (0..bytes).map(|j| (j * 13 + i * 7) as u8).collect();
            (format!("layer.{i:02}"), data)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![d.len()], d);
            (n.clone(), view.unwrap())
        })
        .collect();
    let file = safetensors::serialize(views, None::<HashMap<String, String>>).unwrap();
    (file, tensors)
}

#[test]
fn each_tensor_is_handed_over_once_its_copies_are_queued_and_work_on_it_follows_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("layers.safetensors");
    let (file, tensors) = layers(12, 10_000);
    std::fs::write(&path, &file).unwrap();
    let mut engine = small_slots(4096);
    let sim = engine.sim().unwrap();
    let done = std::cell::Cell::new(0u64);
    let options = LoadOptions::new()
        .readers(3)
        .staging_bytes(4 * 4096)
        .progress(|p| done.set(p.done));
    // Each tensor, as it is handed over, is copied on the device at once: that copy is queued
    // while later tensors are still being read, and ordered after the tensor's own copies.
    let mut copies = Vec::new();
    let mut seen_at = Vec::new();
    checkpoint::load_each(&mut engine, &path, options, |engine, name, tensor| {
        seen_at.push(done.get());
        let copy = crate::support::any_tensor::copy_any(engine, &tensor)?;
        copies.push((name, copy));
        Ok(())
    })
    .unwrap();
    assert_eq!(copies.len(), tensors.len());
    let total = (tensors.len() * 10_000) as u64;
    assert!(
        seen_at[0] < total / 2,
        "the first tensor came at {} of {total} bytes",
        seen_at[0]
    );
    for (name, copy) in &copies {
        let (_, data) = tensors.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!(
            &crate::support::any_tensor::any_bytes(&mut engine, copy).unwrap(),
            data,
            "{name}"
        );
    }
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    // An error of the callback stops the load; what was not handed over is freed.
    drop(copies);
    engine.synchronize().unwrap();
    let before = sim.device_live().0;
    let err = checkpoint::load_each(&mut engine, &path, LoadOptions::new(), |_, _, _| {
        Err(Error::Usage(cuferry::error::UsageError::ZeroLength {
            what: "the caller's refusal",
        }))
    })
    .unwrap_err();
    assert!(err.to_string().contains("the caller's refusal"), "{err}");
    engine.synchronize().unwrap();
    assert_eq!(sim.device_live().0, before, "nothing kept");
}

#[test]
fn direct_and_split_reads_load_the_same_bytes_at_every_alignment() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("odd.safetensors");
    // Tensors of odd sizes, so most start and end off a block boundary.
    let (file, tensors) = layers(7, 70_001);
    std::fs::write(&path, &file).unwrap();
    let mut engine = small_slots(64 << 10);
    let sim = engine.sim().unwrap();
    // Two readers on four slots; then eight, so each slot's read is split in two.
    for (direct, readers) in [(true, 2), (false, 2), (true, 8), (false, 8)] {
        let options = LoadOptions::new()
            .readers(readers)
            .staging_bytes(4 << 16)
            .direct_io(direct);
        let loaded = checkpoint::load_with(&mut engine, &path, options).unwrap();
        for (name, data) in &tensors {
            let t = loaded.get(name).unwrap();
            let back = crate::support::any_tensor::any_bytes(&mut engine, t).unwrap();
            assert!(
                &back == data,
                "{name} (direct: {direct}, {readers} readers)"
            );
        }
    }
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn staging_stays_within_its_setting_and_bad_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("layers.safetensors");
    let (file, _) = layers(8, 20_000);
    std::fs::write(&path, &file).unwrap();
    let mut engine = small_slots(4096);
    let sim = engine.sim().unwrap();
    let peak = std::cell::Cell::new(0usize);
    let options = LoadOptions::new()
        .readers(4)
        .staging_bytes(3 * 4096)
        .progress(|_| peak.set(peak.get().max(sim.pinned_live().1)));
    let loaded = checkpoint::load_with(&mut engine, &path, options).unwrap();
    assert_eq!(loaded.len(), 8);
    assert!(
        peak.get() > 0 && peak.get() <= 3 * 4096,
        "{} pinned bytes",
        peak.get()
    );
    // The slots are kept: a second load makes none (the engine's ring keeps only
    // `ring_depth`, 4 by default, of its own).
    let options = || LoadOptions::new().readers(4).staging_bytes(6 * 4096);
    drop(checkpoint::load_with(&mut engine, &path, options()).unwrap());
    let made = sim.calls(cuferry::sim::SimOp::HostAlloc);
    drop(checkpoint::load_with(&mut engine, &path, options()).unwrap());
    assert_eq!(
        sim.calls(cuferry::sim::SimOp::HostAlloc),
        made,
        "a slot was made again"
    );
    let named = loaded.named();
    let out = dir.path().join("out.safetensors");
    // The save stages through slots the loads made: no pinned memory is added.
    let before = sim.pinned_live().1;
    let peak = std::cell::Cell::new(0usize);
    let options = SaveOptions::new()
        .writers(2)
        .staging_bytes(2 * 4096)
        .progress(|_| peak.set(peak.get().max(sim.pinned_live().1)));
    checkpoint::save_with(&mut engine, &named, &out, options).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), file);
    assert_eq!(peak.get(), before, "pinned bytes during the save");
    for bad in [
        LoadOptions::new().readers(0),
        LoadOptions::new().readers(257),
        LoadOptions::new().staging_bytes(0),
    ] {
        let err = checkpoint::load_with(&mut engine, &path, bad).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Usage(cuferry::error::UsageError::InvalidSetting { .. })
            ),
            "{err}"
        );
    }
    let err = checkpoint::save_with(&mut engine, &named, &out, SaveOptions::new().writers(0));
    assert!(matches!(
        err,
        Err(Error::Usage(
            cuferry::error::UsageError::InvalidSetting { .. }
        ))
    ));
}

#[test]
fn file_ranges_go_to_and_from_tensors_blocking_and_pending() {
    use cuferry::PinnedHostBuffer;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blob");
    let blob: Vec<u8> = (0..100_000u32).map(|i| (i * 31 % 253) as u8).collect();
    std::fs::write(&path, &blob).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let mut engine = small_slots(4096);
    let sim = engine.sim().unwrap();
    // Blocking: a range at an odd offset into a tensor, and the tensor into another file.
    let mut tensor = engine.alloc_tensor::<u8>(&[30_001]).unwrap();
    checkpoint::read_into(&mut engine, &path, &file, 12_345, &mut tensor).unwrap();
    let back = download_tensor(&mut engine, &tensor).unwrap();
    assert!(back == blob[12_345..42_346]);
    let out_path = dir.path().join("out");
    let out = std::fs::File::create(&out_path).unwrap();
    checkpoint::write_from(&mut engine, &tensor, &out_path, &out, 777).unwrap();
    let written = std::fs::read(&out_path).unwrap();
    assert_eq!(written.len(), 777 + 30_001);
    assert!(written[777..] == blob[12_345..42_346]);
    // A range past the end of the file is a short read naming it.
    let err = checkpoint::read_into(&mut engine, &path, &file, 90_000, &mut tensor).unwrap_err();
    assert!(
        matches!(err, Error::Malformed(MalformedError::ShortRead { .. })),
        "{err}"
    );
    // Pending: read into a pinned buffer handed over, the upload in flight; then back down and
    // into the file once returned.
    let buffer = PinnedHostBuffer::<u8>::new(&mut engine, 30_001).unwrap();
    let pending = checkpoint::read_pending(&mut engine, &path, &file, 5, buffer, tensor).unwrap();
    let (buffer, tensor) = pending.wait().unwrap().into_parts();
    assert!(download_tensor(&mut engine, &tensor).unwrap() == blob[5..30_006]);
    let down = cuferry::download_pending(&mut engine, tensor, buffer).unwrap();
    let returned = down.wait().unwrap();
    checkpoint::write_returned(&out_path, &out, 0, &returned).unwrap();
    assert!(std::fs::read(&out_path).unwrap()[..30_001] == blob[5..30_006]);
    // A refusal hands both back: a buffer of another length, or a read past the end.
    let (tensor, buffer) = returned.into_parts();
    let short = PinnedHostBuffer::<u8>::new(&mut engine, 10).unwrap();
    match checkpoint::read_pending(&mut engine, &path, &file, 0, short, tensor) {
        Err(cuferry::SubmitError::Rejected { input, .. }) => {
            assert_eq!((input.0.len(), input.1.len()), (10, 30_001));
            match checkpoint::read_pending(&mut engine, &path, &file, 80_000, buffer, input.1) {
                Err(cuferry::SubmitError::Failed { input, error }) => {
                    assert!(matches!(
                        error,
                        Error::Malformed(MalformedError::ShortRead { .. })
                    ));
                    assert_eq!(input.1.len(), 30_001);
                }
                other => panic!("{other:?}"),
            }
        }
        other => panic!("{other:?}"),
    }
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

#[test]
fn a_tensor_asked_for_as_another_element_type_is_a_typed_error_naming_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, model()).unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut loaded = checkpoint::load(&mut engine, &path).unwrap();
    let err = loaded.take::<f64>("layer.weight").unwrap_err();
    match &err {
        Error::Usage(UsageError::StoredElementType {
            path: file,
            tensor,
            asked,
            holds,
        }) => {
            assert_eq!(file, &path);
            assert_eq!(tensor, "layer.weight");
            assert_eq!((*asked, *holds), (cuferry::DType::F64, cuferry::DType::F32));
        }
        other => panic!("{other:?}"),
    }
    assert!(
        err.to_string().contains("'layer.weight' holds f32"),
        "{err}"
    );
    assert_eq!(loaded.len(), 3, "the tensor stays");
    assert!(matches!(
        loaded.take::<f32>("no.such"),
        Err(Error::Usage(UsageError::NoTensor { .. }))
    ));
    let weight = loaded.take::<f32>("layer.weight").unwrap();
    assert_eq!(download_tensor(&mut engine, &weight).unwrap()[5], 2.5);
    assert_eq!(loaded.len(), 2);
}

/// A writer that fails, or writes nothing, at its `n`-th write.
struct FaultyWriter {
    file: std::fs::File,
    fail_at: usize,
    zero: bool,
    writes: std::sync::atomic::AtomicUsize,
}

impl checkpoint::WriteAt for FaultyWriter {
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<usize> {
        use std::sync::atomic::Ordering;
        if self.writes.fetch_add(1, Ordering::SeqCst) + 1 == self.fail_at {
            if self.zero {
                return Ok(0);
            }
            return Err(std::io::Error::other("injected"));
        }
        std::os::unix::fs::FileExt::write_at(&self.file, buf, offset)
    }
}

#[test]
fn a_write_that_fails_at_any_step_is_reported_and_the_engine_writes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out");
    let data: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
    let mut engine = small_slots(4096);
    let sim = engine.sim().unwrap();
    let tensor = cuferry::upload_tensor(&mut engine, &data, &[data.len()]).unwrap();
    let writer = |fail_at, zero| FaultyWriter {
        file: std::fs::File::create(&path).unwrap(),
        fail_at,
        zero,
        writes: Default::default(),
    };
    let clean = writer(0, false);
    checkpoint::write_from(&mut engine, &tensor, &path, &clean, 0).unwrap();
    let writes = clean.writes.into_inner();
    assert!(writes >= 10, "{writes} writes");
    for fail_at in 1..=writes {
        for zero in [false, true] {
            let w = writer(fail_at, zero);
            match checkpoint::write_from(&mut engine, &tensor, &path, &w, 0) {
                Err(Error::Io(IoError::File { .. })) => {}
                other => panic!("write {fail_at} (zero: {zero}): {other:?}"),
            }
            let w = writer(0, false);
            checkpoint::write_from(&mut engine, &tensor, &path, &w, 0).unwrap();
            assert!(std::fs::read(&path).unwrap() == data, "write {fail_at}");
        }
    }
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    assert_eq!(engine.staging_stats().leased, 0, "every slot came back");
}

// ---- Hostile files and settings (issue 36, items 8 to 12) ----

/// The error of `result`, which must be an [`Error::Usage`] `InvalidSetting` naming `setting`.
fn refused_setting<T: std::fmt::Debug>(result: Result<T, Error>, setting: &str) -> String {
    match result {
        Err(Error::Usage(e @ cuferry::error::UsageError::InvalidSetting { .. })) => {
            let text = e.to_string();
            assert!(text.contains(setting), "{text}");
            text
        }
        other => panic!("{setting}: {other:?}"),
    }
}

/// Every load and save setting at `usize::MAX`, `1 << 62` and zero is a typed refusal naming
/// the setting and its limit, before anything is allocated: never an abort.
#[test]
fn every_staging_setting_out_of_range_is_refused_with_its_limit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("layers.safetensors");
    let (file, _) = layers(3, 5_000);
    std::fs::write(&path, &file).unwrap();
    let mut engine = small_slots(4096);
    let sim = engine.sim().unwrap();
    for huge in [usize::MAX, 1 << 62, (1 << 40) + 1] {
        let text = refused_setting(
            checkpoint::load_with(&mut engine, &path, LoadOptions::new().staging_bytes(huge)),
            "staging_bytes",
        );
        assert!(text.contains("1 TiB"), "{text}");
        refused_setting(
            checkpoint::load_with(&mut engine, &path, LoadOptions::new().readers(huge)),
            "readers",
        );
    }
    refused_setting(
        checkpoint::load_with(&mut engine, &path, LoadOptions::new().staging_bytes(0)),
        "staging_bytes",
    );
    let loaded = checkpoint::load(&mut engine, &path).unwrap();
    let named = loaded.named();
    let out = dir.path().join("out.safetensors");
    for huge in [usize::MAX, 1 << 62, (1 << 40) + 1] {
        let options = SaveOptions::new().staging_bytes(huge);
        let text = refused_setting(
            checkpoint::save_with(&mut engine, &named, &out, options),
            "staging_bytes",
        );
        assert!(text.contains("1 TiB"), "{text}");
        refused_setting(
            checkpoint::save_with(&mut engine, &named, &out, SaveOptions::new().writers(huge)),
            "writers",
        );
    }
    assert!(!out.exists(), "a refused save made a file");
    // The slot size and count are the engine's staging settings: refused there.
    for bad in [usize::MAX, 1 << 62, 0] {
        let mut config = engine.staging_config();
        config.chunk_bytes = bad;
        assert!(
            engine.set_staging_config(config).is_err(),
            "chunk_bytes {bad}"
        );
        let mut config = engine.staging_config();
        config.ring_depth = bad;
        assert!(
            engine.set_staging_config(config).is_err(),
            "ring_depth {bad}"
        );
    }
    // The largest accepted staging still loads (as many slots as the file needs are made).
    let options = LoadOptions::new().staging_bytes(1 << 40);
    assert_eq!(
        checkpoint::load_with(&mut engine, &path, options)
            .unwrap()
            .len(),
        3
    );
    let options = SaveOptions::new().staging_bytes(1 << 40);
    checkpoint::save_with(&mut engine, &named, &out, options).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), file);
    drop(named);
    drop(loaded);
    engine.synchronize().unwrap();
    assert!(sim.violations().is_empty(), "{:?}", sim.violations());
}

/// An index file is read through a bounded reader: a sparse 256 MiB file and a link to
/// `/dev/zero` are typed errors with the limit in them, at once.
#[test]
fn an_index_past_its_limit_is_refused_without_being_read_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let sparse = dir.path().join("sparse.safetensors.index.json");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let zero = dir.path().join("zero.safetensors.index.json");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    for index in [&sparse, &zero] {
        let began = std::time::Instant::now();
        let err = checkpoint::load(&mut engine, index).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Malformed(MalformedError::TooLarge {
                    limit: 100_000_000,
                    ..
                })
            ),
            "{}: {err}",
            index.display()
        );
        assert!(err.to_string().contains("100000000"), "{err}");
        assert!(
            began.elapsed() < std::time::Duration::from_secs(10),
            "{:?}",
            began.elapsed()
        );
    }
}

/// A sharded set of 100,000 tensors plans in linear time: under a second even unoptimised.
#[test]
fn a_sharded_set_of_100_000_tensors_plans_within_a_second() {
    const TENSORS: usize = 100_000;
    const SHARDS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..TENSORS)
        .map(|i| format!("model.layers.{i}.w"))
        .collect();
    let mut weight_map = String::from("{\"weight_map\":{");
    for s in 0..SHARDS {
        let shard = format!("model-{s:05}.safetensors");
        let data = vec![0u8; TENSORS / SHARDS];
        let mine = &names[s * TENSORS / SHARDS..(s + 1) * TENSORS / SHARDS];
        let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = mine
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let byte = &data[i..i + 1];
                let view =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![1], byte);
                (n.as_str(), view.unwrap())
            })
            .collect();
        let bytes = safetensors::serialize(views, None::<HashMap<String, String>>).unwrap();
        std::fs::write(dir.path().join(&shard), bytes).unwrap();
        for n in mine {
            weight_map.push_str(&format!("\"{n}\":\"{shard}\","));
        }
    }
    weight_map.pop();
    weight_map.push_str("}}");
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(&index, weight_map).unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    // Every tensor planned (each shard's header read and checked against the index), none
    // loaded: the time is the plan's. The best of three runs, so that the tests the binary runs
    // beside this one (on CI's two cores) do not decide it: quadratic planning took 43 s here.
    let mut best = std::time::Duration::MAX;
    for _ in 0..3 {
        let mut asked = 0;
        let began = std::time::Instant::now();
        let options = LoadOptions::new().select(|_| {
            asked += 1;
            false
        });
        let loaded = checkpoint::load_with(&mut engine, &index, options).unwrap();
        best = best.min(began.elapsed());
        assert!(loaded.is_empty());
        assert_eq!(asked, TENSORS);
    }
    eprintln!("planned {TENSORS} tensors in {best:?} (the best of three)");
    assert!(
        best < std::time::Duration::from_secs(1),
        "planned in {best:?} at best"
    );
}

/// The temporary files a save may leave in `dir`: none but `keep`.
fn others(dir: &std::path::Path, keep: &[&str]) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect()
}

/// A save writes a temporary file of its own (`create_new`, a unique name): a link planted at
/// the old `<name>.partial` is not followed, and a user's file of that name survives.
#[test]
fn a_save_never_writes_through_a_planted_link_or_over_a_users_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let partial = dir.path().join("m.safetensors.partial");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"someone else's").unwrap();
    std::os::unix::fs::symlink(&victim, &partial).unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let t = AnyTensor::from(upload_tensor(&mut engine, &[1.0f32, 2.0], &[2]).unwrap());
    checkpoint::save(&mut engine, &[("t", &t)], &path).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"someone else's");
    assert!(
        std::fs::symlink_metadata(&partial)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the planted link was moved"
    );
    assert!(
        std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_file(),
        "the checkpoint is a link"
    );
    assert_eq!(checkpoint::load(&mut engine, &path).unwrap().len(), 1);
    // A user's own file of that name.
    std::fs::remove_file(&partial).unwrap();
    std::fs::write(&partial, b"mine").unwrap();
    checkpoint::save(&mut engine, &[("u", &t)], &path).unwrap();
    assert_eq!(std::fs::read(&partial).unwrap(), b"mine");
    assert!(
        checkpoint::load(&mut engine, &path)
            .unwrap()
            .get("u")
            .is_some()
    );
    let left = others(
        dir.path(),
        &["m.safetensors", "m.safetensors.partial", "victim"],
    );
    assert!(left.is_empty(), "temporaries left: {left:?}");
}

/// Two threads saving different tensors to one path, many rounds at once: after each round
/// the file is exactly one of the two saves (byte for byte, and loaded), never a mix, and no
/// temporary is left.
#[test]
fn two_saves_of_one_path_at_once_end_with_one_whole_file() {
    const ROUNDS: usize = 30;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    // One layout, other bytes: a mix would load without error.
    let data = |k: u8| -> Vec<u8> { (0..64 * 1024).map(|i| (i as u8) ^ (k * 0x5a + 1)).collect() };
    let expected: Vec<Vec<u8>> = (0..2u8)
        .map(|k| {
            let d = data(k);
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![d.len()], &d)
                    .unwrap();
            safetensors::serialize(vec![("t", view)], None::<HashMap<String, String>>).unwrap()
        })
        .collect();
    let barrier = std::sync::Barrier::new(3);
    let mut mixes = Vec::new();
    let mut oks = 0;
    std::thread::scope(|scope| {
        let savers: Vec<_> = (0..2u8)
            .map(|k| {
                let (path, barrier, data) = (&path, &barrier, &data);
                scope.spawn(move || {
                    let mut engine = small_slots(4096);
                    let d = data(k);
                    let t = AnyTensor::from(upload_tensor(&mut engine, &d, &[d.len()]).unwrap());
                    let mut outcomes = Vec::new();
                    for _ in 0..ROUNDS {
                        barrier.wait();
                        let options = SaveOptions::new().writers(4).staging_bytes(4 * 4096);
                        outcomes.push(checkpoint::save_with(
                            &mut engine,
                            &[("t", &t)],
                            path,
                            options,
                        ));
                        barrier.wait();
                    }
                    outcomes
                })
            })
            .collect();
        // The checker never panics between the barriers (the savers would wait for ever).
        let mut engine = CudaEngine::simulated(SimConfig::default());
        for round in 0..ROUNDS {
            barrier.wait();
            barrier.wait();
            let written = std::fs::read(&path).unwrap_or_default();
            let loaded = checkpoint::load(&mut engine, &path).and_then(|c| {
                crate::support::any_tensor::any_bytes(&mut engine, c.get("t").unwrap())
            });
            let whole = expected.contains(&written)
                && loaded
                    .as_ref()
                    .is_ok_and(|b| *b == data(0) || *b == data(1));
            if !whole {
                mixes.push(format!(
                    "round {round}: {} bytes, loaded {:?}",
                    written.len(),
                    loaded.err()
                ));
            }
        }
        for saver in savers {
            for outcome in saver.join().unwrap() {
                match outcome {
                    Ok(()) => oks += 1,
                    Err(Error::Io(_) | Error::Malformed(_)) => {}
                    Err(other) => mixes.push(format!("{other}")),
                }
            }
        }
    });
    assert!(mixes.is_empty(), "{mixes:#?}");
    assert!(oks >= ROUNDS, "{oks} saves of {}", 2 * ROUNDS);
    let left = others(dir.path(), &["m.safetensors"]);
    assert!(left.is_empty(), "temporaries left: {left:?}");
}

/// A tensor named `__metadata__` is refused by the save (the load would refuse the file), and
/// names the format allows round-trip.
#[test]
fn a_save_refuses_a_name_the_load_would_refuse_and_keeps_every_other() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let t = AnyTensor::from(upload_tensor(&mut engine, &[3u8, 4], &[2]).unwrap());
    let err = checkpoint::save(&mut engine, &[("a", &t), ("__metadata__", &t)], &path).unwrap_err();
    assert!(
        matches!(&err, Error::Malformed(MalformedError::Header { tensor: Some(n), .. }) if n == "__metadata__"),
        "{err}"
    );
    assert!(others(dir.path(), &[]).is_empty(), "a file was made");
    let odd = [
        "",
        "a\"b\\c",
        "\u{0}\n",
        "ü/../x",
        "__metadata",
        " __metadata__",
    ];
    let named: Vec<(&str, &dyn SaveTensor)> = odd.iter().map(|n| (*n, &t as _)).collect();
    checkpoint::save(&mut engine, &named, &path).unwrap();
    let loaded = checkpoint::load(&mut engine, &path).unwrap();
    for n in odd {
        assert!(loaded.get(n).is_some(), "{n:?}");
    }
}

/// A reader that answers `Interrupted` on every other call, the length probes included.
struct Interrupting<'a> {
    bytes: &'a [u8],
    calls: std::sync::atomic::AtomicUsize,
}

impl checkpoint::ReadAt for Interrupting<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n.is_multiple_of(2) {
            return Err(std::io::ErrorKind::Interrupted.into());
        }
        self.bytes.read_at(buf, offset)
    }
}

/// Every read of a load retries `Interrupted`: the header's, the chunks' and the final length
/// probe's.
#[test]
fn a_reader_interrupted_on_every_other_call_loads_the_same_bytes() {
    let (file, tensors) = layers(5, 9_000);
    let mut engine = small_slots(4096);
    let reader = Interrupting {
        bytes: &file,
        calls: std::sync::atomic::AtomicUsize::new(0),
    };
    let options = LoadOptions::new().readers(3).staging_bytes(4 * 4096);
    let loaded = checkpoint::load_from(
        &mut engine,
        std::path::Path::new("interrupted.safetensors"),
        &reader,
        file.len() as u64,
        options,
    )
    .unwrap();
    for (name, data) in &tensors {
        let back =
            crate::support::any_tensor::any_bytes(&mut engine, loaded.get(name).unwrap()).unwrap();
        assert_eq!(&back, data, "{name}");
    }
    // And a file range read through it.
    let mut t = engine.alloc_tensor::<u8>(&[5000]).unwrap();
    checkpoint::read_into(&mut engine, std::path::Path::new("r"), &reader, 100, &mut t).unwrap();
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), &file[100..5100]);
}

/// Looking a name up in a checkpoint of many tensors is not a scan: 20,000 lookups and
/// removals of a 20,000-tensor checkpoint take well under a second.
#[test]
fn name_lookups_in_a_large_checkpoint_are_not_scans() {
    const TENSORS: usize = 20_000;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("many.safetensors");
    let names: Vec<String> = (0..TENSORS).map(|i| format!("t{i}")).collect();
    let empty: [u8; 0] = [];
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = names
        .iter()
        .map(|n| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![0], &empty);
            (n.as_str(), view.unwrap())
        })
        .collect();
    std::fs::write(
        &path,
        safetensors::serialize(views, None::<HashMap<String, String>>).unwrap(),
    )
    .unwrap();
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let mut loaded = checkpoint::load(&mut engine, &path).unwrap();
    assert_eq!(loaded.len(), TENSORS);
    let began = std::time::Instant::now();
    for n in names.iter().rev() {
        assert!(loaded.get(n).is_some());
    }
    for n in names.iter().rev() {
        assert!(loaded.remove(n).is_some(), "{n}");
    }
    let took = began.elapsed();
    assert!(loaded.is_empty());
    assert!(took < std::time::Duration::from_millis(500), "{took:?}");
}

/// The index's JSON is held to what the header's is: a field given twice, a name given twice,
/// a shard that is not a string or not beside the index, text that is not UTF-8, are typed
/// refusals naming the index.
#[test]
fn an_index_that_repeats_a_key_or_is_not_an_index_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _) = layers(1, 16);
    std::fs::write(dir.path().join("s.safetensors"), &file).unwrap();
    let index = dir.path().join("m.safetensors.index.json");
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let cases: [(&[u8], &str); 8] = [
        (
            br#"{"weight_map":{"layer.00":"s.safetensors"},"weight_map":{"layer.00":"s.safetensors"}}"#,
            "duplicate field",
        ),
        (
            br#"{"weight_map":{"layer.00":"s.safetensors","layer.00":"s.safetensors"}}"#,
            "twice",
        ),
        (br#"{"weight_map":{"layer.00":7}}"#, "not an index"),
        (br#"{"weight_map":["layer.00"]}"#, "not an index"),
        (br#"{"metadata":{}}"#, "not an index"),
        (br#"{"weight_map":{"layer.00":"../s.safetensors"}}"#, "beside"),
        (b"{\"weight_map\":{\"layer.00\":\"s.safetensors\xff\"}}", "UTF-8"),
        (br#"{"weight_map":{"layer.00":"s.safetensors"}} trailing"#, "not an index"),
    ];
    for (json, want) in cases {
        std::fs::write(&index, json).unwrap();
        let err = checkpoint::load(&mut engine, &index).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(want) && text.contains("m.safetensors.index.json"),
            "{}: {text}",
            String::from_utf8_lossy(json)
        );
    }
    // Escapes in a name or a shard are read as the text they spell.
    std::fs::write(
        &index,
        br#"{"weight_map":{"layer.\u0030\u0030":"s.safe\u0074ensors"}}"#,
    )
    .unwrap();
    let loaded = checkpoint::load(&mut engine, &index).unwrap();
    assert!(loaded.get("layer.00").is_some());
}

/// `save` takes the tensors borrowed, of any element types at once, source first: the tensors,
/// then the file. They stay the caller's, and the file is the format's serializer's.
#[test]
fn a_save_takes_borrowed_tensors_of_mixed_element_types_source_first() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let weights: Vec<f32> = (0..32u32 * 24).map(|i| i as f32 * 0.5).collect();
    let weight = upload_tensor(&mut engine, &weights, &[32, 24]).unwrap();
    let biases: Vec<bf16> = (0..24u16).map(|i| bf16::from_f32(f32::from(i))).collect();
    let bias = upload_tensor(&mut engine, &biases, &[24]).unwrap();
    let steps = upload_tensor(&mut engine, &[7u64], &[1]).unwrap();
    checkpoint::save(
        &mut engine,
        &[
            ("layer.weight", &weight),
            ("layer.bias", &bias),
            ("steps", &steps),
        ],
        &path,
    )
    .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), model());
    // Borrowed, not taken: the tensors are still the caller's.
    assert_eq!(download_tensor(&mut engine, &weight).unwrap(), weights);
    assert_eq!(download_tensor(&mut engine, &bias).unwrap(), biases);
    // A checkpoint's own tensors save the same way, beside typed ones.
    let mut loaded = checkpoint::load(&mut engine, &path).unwrap();
    let again = dir.path().join("again.safetensors");
    let typed = loaded.take::<f32>("layer.weight").unwrap();
    let named: Vec<(&str, &dyn checkpoint::SaveTensor)> = vec![
        ("layer.weight", &typed),
        ("layer.bias", loaded.get("layer.bias").unwrap()),
        ("steps", &steps),
    ];
    checkpoint::save_with(&mut engine, &named, &again, SaveOptions::new()).unwrap();
    assert_eq!(std::fs::read(&again).unwrap(), model());
}

/// `into_typed` refuses another element type with an error that `?` carries, into a
/// `Box<dyn Error>` or a `cuferry::Error`, saying what was asked and what the tensor is; the
/// tensor comes back in it.
#[test]
fn into_typed_refuses_another_type_with_an_error_question_mark_carries() {
    use cuferry::SubmitError;
    let mut engine = CudaEngine::simulated(SimConfig::default());
    let tensor = AnyTensor::from(upload_tensor(&mut engine, &[1.0f32; 6], &[2, 3]).unwrap());
    let err = tensor.into_typed::<u32>().unwrap_err();
    let message = err.to_string();
    assert!(message.contains("u32"), "{message}");
    assert!(message.contains("f32"), "{message}");
    assert!(message.contains("[2, 3]"), "{message}");
    match &err {
        SubmitError::Rejected {
            error:
                Error::Usage(cuferry::error::UsageError::ElementTypeMismatch {
                    operation: "into_typed",
                    asked: cuferry::DType::U32,
                    holds: cuferry::DType::F32,
                    shape,
                }),
            ..
        } => assert_eq!(shape, &[2, 3]),
        other => panic!("expected an element type refusal, got {other:?}"),
    }
    let tensor = err.into_input().expect("the tensor comes back");
    assert_eq!(tensor.shape(), [2, 3]);

    fn boxed(t: AnyTensor) -> Result<cuferry::DeviceTensor<u32>, Box<dyn std::error::Error>> {
        Ok(t.into_typed::<u32>()?)
    }
    fn crate_error(t: AnyTensor) -> cuferry::Result<cuferry::DeviceTensor<f32>> {
        Ok(t.into_typed::<f32>()?)
    }
    let message = boxed(tensor).unwrap_err().to_string();
    assert!(
        message.contains("u32") && message.contains("f32"),
        "{message}"
    );
    let tensor = AnyTensor::from(upload_tensor(&mut engine, &[2.0f32; 6], &[2, 3]).unwrap());
    let typed = crate_error(tensor).unwrap();
    assert_eq!(download_tensor(&mut engine, &typed).unwrap(), [2.0f32; 6]);
    let tensor = AnyTensor::from(upload_tensor(&mut engine, &[3u32; 2], &[2]).unwrap());
    assert!(matches!(
        crate_error(tensor),
        Err(Error::Usage(
            cuferry::error::UsageError::ElementTypeMismatch { .. }
        ))
    ));
}

// ---- Reading once for every rank ----

/// A simulated machine of `devices` devices, an engine on each, with small staging slots.
fn world(devices: usize) -> (cuferry::sim::SimDevice, Vec<CudaEngine>) {
    let sim = cuferry::sim::SimDevice::new(SimConfig {
        devices,
        ..SimConfig::default()
    });
    let engines = (0..devices)
        .map(|d| {
            let mut engine = CudaEngine::simulated_on_device(&sim, d).unwrap();
            let mut config = cuferry::staging::StagingConfig::default();
            config.chunk_bytes = 4096;
            config.cutoff_bytes = 1024;
            engine.set_staging_config(config).unwrap();
            engine
        })
        .collect();
    (sim, engines)
}

/// Worlds of 2, 3 and 8 ranks load a file and a sharded set once between them: every rank
/// holds every tensor, equal to a plain load's, converted where asked, and the bytes read (the
/// progress of the whole world, whose ranks are all in this process) are the file's tensors'
/// once, not once per rank.
#[test]
fn a_world_reads_each_byte_once_and_every_rank_holds_every_tensor() {
    let dir = tempfile::tempdir().unwrap();
    // 11 tensors of 1,000 to 11,000 bytes: several slots each, uneven shares.
    let tensors: Vec<(String, Vec<u8>)> = (0..11)
        .map(|i| {
            let data = (0..1000 * (i + 1))
                .map(|j| (j * 31 + i * 7) as u8)
                .collect();
            (format!("layer.{i:02}"), data)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![d.len()], d);
            (n.clone(), view.unwrap())
        })
        .collect();
    let path = dir.path().join("model.safetensors");
    safetensors::serialize_to_file(views.clone(), None::<HashMap<String, String>>, &path).unwrap();
    // The same tensors as a set of three shards.
    let mut map = Vec::new();
    for (s, part) in views.chunks(4).enumerate() {
        let name = format!("model-{s}.safetensors");
        let file = dir.path().join(&name);
        safetensors::serialize_to_file(part.to_vec(), None::<HashMap<String, String>>, &file)
            .unwrap();
        map.extend(part.iter().map(|(t, _)| format!(r#""{t}": "{name}""#)));
    }
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        format!(r#"{{"weight_map": {{{}}}}}"#, map.join(", ")),
    )
    .unwrap();
    let total: u64 = tensors.iter().map(|(_, d)| d.len() as u64).sum();
    for devices in [2, 3, 8] {
        for file in [&path, &index] {
            let (sim, mut engines) = world(devices);
            let mut refs: Vec<&mut CudaEngine> = engines.iter_mut().collect();
            let comm = cuferry::collective::Communicator::new(&mut refs).unwrap();
            let mut read = 0;
            // Every tensor but one; `layer.03` as u32 words, converted on each rank.
            let options = LoadOptions::new()
                .readers(3)
                .select(|n| n != "layer.05")
                .convert(|n, dtype| {
                    if n == "layer.03" {
                        cuferry::DType::U32
                    } else {
                        dtype
                    }
                })
                .progress(|p| read = p.done);
            let loaded = checkpoint::load_shared(&comm, &mut refs, file, options).unwrap();
            assert_eq!(read, total - 6000, "{devices} ranks, {}", file.display());
            assert_eq!(loaded.len(), devices);
            for (rank, (engine, checkpoint)) in engines.iter_mut().zip(loaded).enumerate() {
                let names: Vec<&str> = checkpoint.names().collect();
                assert_eq!(names.len(), 10, "rank {rank}");
                for (name, data) in &tensors {
                    let Some(tensor) = checkpoint.get(name) else {
                        assert_eq!(name, "layer.05");
                        continue;
                    };
                    if name == "layer.03" {
                        let words = download_tensor(engine, tensor.as_typed::<u32>().unwrap());
                        let want: Vec<u32> = data.iter().map(|&b| u32::from(b)).collect();
                        assert_eq!(words.unwrap(), want, "rank {rank}");
                        continue;
                    }
                    let got = crate::support::any_tensor::any_bytes(engine, tensor).unwrap();
                    assert!(got == *data, "{devices} ranks: rank {rank}, {name}");
                }
            }
            for engine in &mut engines {
                engine.synchronize().unwrap();
            }
            assert!(sim.violations().is_empty(), "{:?}", sim.violations());
        }
    }
}

/// What `load_shared` refuses, before it reads anything: engines that are not the
/// communicator's ranks here, and slices (every rank receives every tensor whole).
#[test]
fn a_shared_load_refuses_slices_and_the_wrong_engines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, model()).unwrap();
    let (_sim, mut engines) = world(2);
    let mut refs: Vec<&mut CudaEngine> = engines.iter_mut().collect();
    let comm = cuferry::collective::Communicator::new(&mut refs).unwrap();
    let err =
        checkpoint::load_shared(&comm, &mut refs[..1], &path, LoadOptions::new()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Usage(UsageError::RankCount {
                ranks: 2,
                engines: 1,
                ..
            })
        ),
        "{err:?}"
    );
    let sliced = LoadOptions::new().slices(|_, _| Ok(checkpoint::Slice::Whole));
    let err = checkpoint::load_shared(&comm, &mut refs, &path, sliced).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Usage(UsageError::NotTaken {
                setting: "slices",
                ..
            })
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("load_shared"), "{err}");
    // The engines work on: a shared load of the whole file.
    let loaded = checkpoint::load_shared(&comm, &mut refs, &path, LoadOptions::new()).unwrap();
    assert_eq!(loaded[1].len(), 3);
}

// ---- Small tensors packed into one allocation ----

/// A checkpoint of 300 small tensors (1 byte to 3 KiB, of four element types): the load packs
/// them into a few allocations, one copy each, and every tensor is a part of its own. Under
/// interleaved schedules, with a copy queued on each tensor as it is handed over and half the
/// tensors (or all of them) dropped at once, every copy reads the file's bytes, no allocation is freed under a
/// use of any of its parts (the device reports no race), and once every tensor is gone every
/// allocation is freed.
#[test]
fn small_tensors_share_an_allocation_that_outlives_every_use_of_each() {
    use safetensors::Dtype as Sd;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("norms.safetensors");
    let tensors: Vec<(String, Sd, Vec<u8>)> = (0..300usize)
        .map(|i| {
            let (dtype, elem) = [(Sd::U8, 1), (Sd::F32, 4), (Sd::BF16, 2), (Sd::BOOL, 1)][i % 4];
            let n = 1 + (i * 37) % (3000 / elem);
            let data = (0..n * elem)
                .map(|j| match dtype {
                    Sd::BOOL => (j % 3 == 0) as u8,
                    _ => (j * 7 + i) as u8,
                })
                .collect();
            (format!("block.{i:03}.norm"), dtype, data)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, b)| {
            let elem = if *d == Sd::F32 {
                4
            } else if *d == Sd::BF16 {
                2
            } else {
                1
            };
            let view = safetensors::tensor::TensorView::new(*d, vec![b.len() / elem], b);
            (n.clone(), view.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None::<HashMap<String, String>>, &path).unwrap();
    for seed in 0..12 {
        let sim = cuferry::sim::SimDevice::new(SimConfig::default());
        sim.set_schedule(cuferry::sim::Schedule::Interleaved { seed });
        let mut engine = CudaEngine::simulated_on(&sim);
        let mut config = cuferry::staging::StagingConfig::default();
        config.chunk_bytes = 64 << 10;
        config.cutoff_bytes = 4096;
        engine.set_staging_config(config).unwrap();
        let (live, _) = sim.device_live();
        let allocations = sim.calls(cuferry::sim::SimOp::Alloc);
        let mut copies = Vec::new();
        let options = LoadOptions::new().readers(3).staging_bytes(256 << 10);
        let mut kept = Vec::new();
        checkpoint::load_each(&mut engine, &path, options, |engine, name, tensor| {
            let copy = match tensor.as_typed::<u8>() {
                Some(t) => AnyTensor::from(engine.copy_tensor(t)?),
                None => match tensor.as_typed::<f32>() {
                    Some(t) => AnyTensor::from(engine.copy_tensor(t)?),
                    None => match tensor.as_typed::<bf16>() {
                        Some(t) => AnyTensor::from(engine.copy_tensor(t)?),
                        None => {
                            AnyTensor::from(engine.copy_tensor(tensor.as_typed::<bool>().unwrap())?)
                        }
                    },
                },
            };
            let i: usize = name["block.".len()..][..3].parse().unwrap();
            // Odd seeds keep half the tensors; even seeds drop every one at once, so each
            // allocation is freed while the copies out of its parts are still queued.
            if seed % 2 == 1 && i.is_multiple_of(2) {
                kept.push((i, tensor));
            } // else dropped now, its copy still queued
            copies.push((i, copy));
            Ok(())
        })
        .unwrap();
        let made = sim.calls(cuferry::sim::SimOp::Alloc) - allocations;
        // 300 tensors in a handful of allocations, beside the 300 copies'.
        assert!(made < 300 + 20, "{made} allocations");
        for (i, copy) in &copies {
            let got = crate::support::any_tensor::any_bytes(&mut engine, copy).unwrap();
            assert!(got == tensors[*i].2, "seed {seed}: tensor {i}");
        }
        for (i, tensor) in &kept {
            let got = crate::support::any_tensor::any_bytes(&mut engine, tensor).unwrap();
            assert!(got == tensors[*i].2, "seed {seed}: tensor {i}");
        }
        drop(copies);
        drop(kept);
        engine.synchronize().unwrap();
        assert!(
            sim.violations().is_empty(),
            "seed {seed}: {:?}",
            sim.violations()
        );
        assert_eq!(
            sim.device_live().0,
            live,
            "seed {seed}: every allocation freed"
        );
    }
}

/// A small tensor a load packed with others is part of a larger allocation: offered for
/// sharing with another process it is refused, handed back, and a copy of it is shared.
#[test]
fn a_packed_tensor_is_not_shared_but_a_copy_of_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("norms.safetensors");
    let (file, tensors) = layers(4, 300);
    std::fs::write(&path, &file).unwrap();
    let mut engine = small_slots(64 << 10);
    let mut loaded = checkpoint::load(&mut engine, &path).unwrap();
    let part = loaded.take::<u8>("layer.02").unwrap();
    let refused = engine.export_tensor(part).unwrap_err();
    let error = refused.to_string();
    let part = match refused {
        cuferry::SubmitError::Rejected {
            input,
            error: Error::Usage(UsageError::Reexport),
        } => input,
        other => panic!("{other:?}"),
    };
    assert!(error.contains("part of a larger allocation"), "{error}");
    assert_eq!(download_tensor(&mut engine, &part).unwrap(), tensors[2].1);
    let copy = engine.copy_tensor(&part).unwrap();
    assert!(engine.export_tensor(copy).is_ok());
}
