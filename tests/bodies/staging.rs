//! The blocking routes' staging settings, on either device.

use super::Device;
use cuferry::Error;
use cuferry::error::UsageError;

pub(crate) fn staging_settings_are_validated(dev: Device) {
    let mut engine = dev.engine();
    let mut config = engine.staging_config();
    config.ring_depth = 0;
    assert!(matches!(
        engine.set_staging_config(config),
        Err(Error::Usage(UsageError::InvalidSetting {
            setting: "ring_depth",
            ..
        }))
    ));
    let mut config = engine.staging_config();
    config.cutoff_bytes = config.chunk_bytes + 1;
    assert!(matches!(
        engine.set_staging_config(config),
        Err(Error::Usage(UsageError::InvalidSetting {
            setting: "cutoff_bytes",
            ..
        }))
    ));
}

/// Every body of this module as tests of one binary: `tests!(sim)` in the simulator's, `tests!(gpu)`
/// in the GPU suite's, so both run the same list.
macro_rules! tests {
    ($device:ident) => {
        crate::bodies!($device; staging::{
            staging_settings_are_validated,
        });
    };
}
pub(crate) use tests;
