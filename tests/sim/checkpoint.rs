//! Checkpoint files through the public API on the simulated device: a file the format's own
//! serializer wrote loads bit for bit, typed; a save of those tensors is the same file; a
//! selection reads only what it selects; a bad file is a typed error naming it, and the engine
//! works on.

use cuferry::checkpoint::{self, Tensor};
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
    let loaded =
        checkpoint::load_selected(&mut engine, &path, |name| name.ends_with("bias")).unwrap();
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
