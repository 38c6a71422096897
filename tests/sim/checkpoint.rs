//! Checkpoint files through the public API on the simulated device: a file the format's own
//! serializer wrote loads bit for bit, typed; a save of those tensors is the same file; a
//! selection reads only what it selects; a bad file is a typed error naming it, and the engine
//! works on.

use cuferry::checkpoint::{self, LoadOptions, Progress, SaveOptions, Tensor};
use cuferry::error::CheckpointError;
use cuferry::sim::SimConfig;
use cuferry::{CudaEngine, Error, bf16, download_tensor, upload_tensor};
use std::collections::HashMap;

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
    let weight = Tensor::from(weight);
    let again = dir.path().join("again.safetensors");
    let steps = Tensor::from(upload_tensor(&mut engine, &[7u64], &[1]).unwrap());
    checkpoint::save(
        &mut engine,
        &again,
        &[
            ("steps", &steps),
            ("layer.weight", &weight),
            ("layer.bias", bias),
        ],
    )
    .unwrap();
    assert_eq!(std::fs::read(&again).unwrap(), model());
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
        matches!(err, Error::Checkpoint(CheckpointError::DataLength { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("broken.safetensors"), "{err}");
    let missing = checkpoint::load(&mut engine, dir.path().join("absent")).unwrap_err();
    assert!(
        matches!(
            missing,
            Error::Checkpoint(CheckpointError::Io {
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
    let named: Vec<(&str, &Tensor)> = loaded.iter().collect();
    let out = dir.path().join("out.safetensors");
    checkpoint::save_with(
        &mut engine,
        &out,
        &named,
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
        download_tensor(&mut engine, loaded.get("b").unwrap().bytes()).unwrap(),
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
        matches!(err, Error::Checkpoint(CheckpointError::MissingShard { .. })),
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
