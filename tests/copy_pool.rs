//! The process's shared copy threads: their number is set before first use, reads back, and is
//! fixed once a transfer has used them. One test, alone in its binary (its own process), so no
//! other test can build the pool first.

use cuferry::error::UsageError;
use cuferry::sim::SimConfig;
use cuferry::{CudaEngine, Error, download_tensor, upload_tensor};

#[test]
fn the_number_of_copy_threads_is_set_before_first_use_and_fixed_after() {
    // Out of range: refused, nothing changes.
    let before = cuferry::staging::copy_threads();
    assert!(matches!(
        cuferry::staging::set_copy_threads(0),
        Err(Error::Usage(UsageError::InvalidSetting {
            setting: "copy_threads",
            value: 0,
            ..
        }))
    ));
    assert_eq!(cuferry::staging::copy_threads(), before);

    // Before first use: accepted (the last value counts) and read back.
    cuferry::staging::set_copy_threads(2).unwrap();
    cuferry::staging::set_copy_threads(3).unwrap();
    assert_eq!(cuferry::staging::copy_threads(), 3);

    // A new engine's per-transfer cap defaults to the pool's size.
    let mut engine = CudaEngine::simulated(SimConfig::default());
    assert_eq!(engine.staging_config().copy_threads, 3);

    // A transfer of a few MiB builds the pool with that size.
    let n = (3 << 20) / 4 + 1;
    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let t = upload_tensor(&mut engine, &data, &[n]).unwrap();
    assert_eq!(download_tensor(&mut engine, &t).unwrap(), data);
    assert_eq!(cuferry::staging::copy_threads(), 3);

    // After first use: refused with the reason, the size unchanged.
    match cuferry::staging::set_copy_threads(5) {
        Err(Error::Usage(UsageError::InvalidSetting {
            setting: "copy_threads",
            value: 5,
            reason,
        })) => assert!(reason.contains("already running"), "{reason}"),
        other => panic!("expected InvalidSetting, got {other:?}"),
    }
    assert_eq!(cuferry::staging::copy_threads(), 3);

    // Engines made later still default to the pool's size, and a larger cap is accepted.
    let mut other = CudaEngine::simulated(SimConfig::default());
    assert_eq!(other.staging_config().copy_threads, 3);
    let mut config = other.staging_config();
    config.copy_threads = 64;
    other.set_staging_config(config).unwrap();
    let t = upload_tensor(&mut other, &data, &[n]).unwrap();
    assert_eq!(download_tensor(&mut other, &t).unwrap(), data);
    assert!(engine.sim().unwrap().violations().is_empty());
    assert!(other.sim().unwrap().violations().is_empty());
}
