//! `cuferry._native`: the compiled half of cuferry's Python module (PyO3, stable ABI 3.9+).
//!
//! A thin face over the crate's routes for PyTorch users: safetensors checkpoints loaded
//! through the crate's loader ([`load`]) and saved through its writer ([`save`]), and DLPack
//! both ways ([`from_dlpack`], [`Tensor::__dlpack__`]). The pure-Python half, `cuferry/__init__.py`,
//! checks and normalises the arguments and hands the loaded tensors to torch when it is there.
//!
//! Three rules hold everywhere here:
//!
//! - One engine per device ordinal per process, opened on first use and kept ([`engines`]).
//! - Every wait for an engine, and every load, save, export and import, runs detached from the
//!   interpreter (`Python::detach`, the old `allow_threads`), so other Python threads run
//!   meanwhile; a load's callbacks re-attach to run.
//! - The crate's errors become `cuferry.Error` with the crate's message, which names the file
//!   and the tensor; what the caller passed wrong is a `ValueError`, `TypeError` or
//!   `BufferError` ([`errors`]).

mod capsule;
mod engines;
mod errors;
mod routes;
mod tensor;

use pyo3::prelude::*;

/// The module `cuferry._native`.
#[pymodule]
mod _native {
    #[pymodule_export]
    use crate::routes::{from_dlpack, load, save};
    #[pymodule_export]
    use crate::tensor::Tensor;

    use super::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        let py = m.py();
        m.add("Error", py.get_type::<crate::errors::Error>())?;
        m.add("UsageError", crate::errors::usage_error_type(py)?)?;
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        // Only in a build with the simulated device (feature `sim`), for tests without a GPU.
        #[cfg(feature = "sim")]
        m.add_function(pyo3::wrap_pyfunction!(crate::engines::_use_simulator, m)?)?;
        Ok(())
    }
}
