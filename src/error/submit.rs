//! [`SubmitError<P>`]: the one error of every call that takes something by value.

use super::Error;
use std::fmt;

/// The error of a call that took `P` by value (a submission of work to the device, or a
/// constructor or conversion that consumes its input), handing back what it can, as
/// [`TrySendError<T>`](std::sync::mpsc::TrySendError) does: nothing the caller owned is lost,
/// and nothing the device may still touch comes back.
///
/// There are exactly three outcomes, whatever the operation:
///
/// - [`Rejected`](Self::Rejected): refused before anything was queued; the input comes back
///   untouched. The error says what was wrong with it.
/// - [`Failed`](Self::Failed): the driver refused a step, or the work was queued and then proven
///   complete by other means; nothing is in flight, and the input comes back.
/// - [`Retained`](Self::Retained): the work was queued, but nothing can prove it complete, so
///   the device may still touch the input: its engine (each rank's engine, for a collective)
///   keeps it, releasing what a later proof covers and retaining the rest for its lifetime.
///   Nothing comes back.
///
/// ```
/// # use cuferry::sim::SimConfig;
/// use cuferry::{upload_pending, CudaEngine, PinnedHostBuffer, SubmitError};
/// # let mut engine = CudaEngine::simulated(SimConfig::default());
/// let buffer = PinnedHostBuffer::from_slice(&mut engine, &[1.0f32, 2.0])?;
/// let tensor = engine.alloc_tensor::<f32>(&[3])?; // one element too many
/// match upload_pending(&mut engine, buffer, tensor) {
///     Err(SubmitError::Rejected { input: (buffer, tensor), error }) => {
///         assert_eq!((buffer.len(), tensor.len()), (2, 3)); // both back, untouched
///         println!("refused: {error}");
///     }
///     other => panic!("expected a refusal, got {other:?}"),
/// }
/// # Ok::<(), cuferry::Error>(())
/// ```
// Not `#[non_exhaustive]`: the three outcomes are the whole story, so a match on them is
// exhaustive.
#[derive(thiserror::Error)]
pub enum SubmitError<P> {
    /// Refused before anything was queued: the input comes back untouched.
    #[error("rejected: {error}")]
    Rejected {
        /// What was given, untouched.
        input: P,
        /// What was wrong with it.
        error: Error,
    },
    /// The driver refused a step, or the queued work was proven complete by other means:
    /// nothing is in flight and the input comes back.
    #[error("not queued: {error}")]
    Failed {
        /// What was given.
        input: P,
        /// The failure.
        error: Error,
    },
    /// Queued, but its completion cannot be proven: the device may still touch the input, so
    /// its engine keeps it (for its lifetime, where no later proof covers it); nothing comes
    /// back.
    #[error("queued, but its completion cannot be proven; its memory is retained: {error}")]
    Retained {
        /// The failure.
        error: Error,
    },
}

impl<P> SubmitError<P> {
    /// The error, whatever became of the input.
    pub fn error(&self) -> &Error {
        match self {
            SubmitError::Rejected { error, .. }
            | SubmitError::Failed { error, .. }
            | SubmitError::Retained { error } => error,
        }
    }

    /// The error, dropping the input if it came back.
    pub fn into_error(self) -> Error {
        match self {
            SubmitError::Rejected { error, .. }
            | SubmitError::Failed { error, .. }
            | SubmitError::Retained { error } => error,
        }
    }

    /// The input, when it came back ([`Rejected`](Self::Rejected) or [`Failed`](Self::Failed)).
    pub fn into_input(self) -> Option<P> {
        match self {
            SubmitError::Rejected { input, .. } | SubmitError::Failed { input, .. } => Some(input),
            SubmitError::Retained { .. } => None,
        }
    }

    /// The same outcome with the input mapped by `f`: for a caller that hands back less (or
    /// more) than it was given.
    pub fn map_input<Q>(self, f: impl FnOnce(P) -> Q) -> SubmitError<Q> {
        match self {
            SubmitError::Rejected { input, error } => SubmitError::Rejected {
                input: f(input),
                error,
            },
            SubmitError::Failed { input, error } => SubmitError::Failed {
                input: f(input),
                error,
            },
            SubmitError::Retained { error } => SubmitError::Retained { error },
        }
    }
}

// Not derived: the input need not be `Debug` (a buffer's bytes say nothing useful), and the error
// carries the story.
impl<P> fmt::Debug for SubmitError<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, returned) = match self {
            SubmitError::Rejected { .. } => ("Rejected", true),
            SubmitError::Failed { .. } => ("Failed", true),
            SubmitError::Retained { .. } => ("Retained", false),
        };
        f.debug_struct(name)
            .field("input_returned", &returned)
            .field("error", self.error())
            .finish()
    }
}

impl<P> From<SubmitError<P>> for Error {
    fn from(e: SubmitError<P>) -> Error {
        e.into_error()
    }
}
