//! The context guard of the scopes that hand the engine's context to other code.
//!
//! A raw scope ([`CudaEngine::with_raw`](crate::CudaEngine::with_raw)) and a CubeCL scope both
//! make the engine's context current on the calling thread for the duration of a closure and must
//! restore whatever was current before, on return, on `Err` and on unwind. That rule is written
//! once, here, as a guard whose drop restores; the scopes themselves are work-level code built on
//! it.

use super::engine::Shared;
use crate::driver::ContextHandle;
use crate::error::{Error, Result};
use std::sync::Arc;

/// Makes an engine's context current on the calling thread for as long as it lives, and restores
/// the context that was current before when dropped: on return, on `Err` and on unwind. Raw and
/// CubeCL scopes are built on it.
pub(crate) struct ContextScope {
    shared: Arc<Shared>,
    previous: ContextHandle,
    what: &'static str,
}

impl ContextScope {
    /// Saves the current context and makes the engine's current. `what` names the scope in a
    /// deferred restore failure.
    pub(crate) fn enter(shared: &Arc<Shared>, what: &'static str) -> Result<Self> {
        let st = shared.lock();
        let previous = st
            .driver
            .current_context()
            .map_err(Error::driver("cuCtxGetCurrent"))?;
        st.driver
            .set_current_context(st.driver.context())
            .map_err(Error::driver("cuCtxSetCurrent"))?;
        Ok(ContextScope {
            shared: Arc::clone(shared),
            previous,
            what,
        })
    }
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        if let Err(source) = st.driver.set_current_context(self.previous) {
            st.defer(Error::Driver {
                call: self.what,
                source,
            });
        }
    }
}
