//! The collective half of the device seam: communicators over several devices, and the group of
//! calls that queues one collective on every rank's stream.
//!
//! Collectives follow NCCL's model, whatever runs them. A set of [`Communicators`] joins devices,
//! one rank each, in a given order ([`Collectives::communicators`]). One collective is a group:
//! [`Communicators::group`] opens it, one call per rank ([`Group::queue`]) adds each part on
//! that rank's stream, and [`Group::end`] launches them together, so that one thread drives
//! every device; the group's type ends it exactly once on every path. Every rank's part runs once all of them have reached
//! their streams' heads, and they run together.
//!
//! The failure modes are NCCL's too, and the caller must allow for all of them: a call inside a
//! group may be refused, and the group is still ended; the end may fail; and once a group
//! has started, a failure does not say which ranks' parts were launched. A part launched without
//! its partners can never complete as a collective. So after any failure past the group's start
//! every rank's buffer must be treated as in use by the device until an event recorded after the
//! group on that rank's stream proves otherwise.
//!
//! A real device uses NCCL, loaded at run time, with one communicator per device made by
//! `ncclCommInitAll`. The simulated machine runs the collectives itself, with NCCL's rank rules,
//! and fault injection for each call: a part refused inside a group leaves the other ranks'
//! parts launched, which the simulator then fails on their streams (as an aborted communicator's
//! kernels would end) instead of leaving them waiting for ever, and the failure is what the next
//! event recorded after the part on that stream reports.

use super::DevicePtr;
use crate::dtype::DType;
use crate::error::{DeviceId, Error};

/// What a collective does with its ranks' buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CollectiveKind {
    /// Every buffer becomes the element-wise reduction of all of them.
    AllReduce(Reduction),
    /// Every buffer becomes a copy of rank `root`'s.
    Broadcast {
        /// The rank whose buffer is copied.
        root: usize,
    },
}

/// How an all-reduce combines elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduction {
    Sum,
    Prod,
    Max,
    Min,
    /// The sum divided by the number of ranks (truncated, for integers).
    Avg,
}

/// One rank's part of a collective, in place: `count` elements of `dtype` at `buffer`, on the
/// compute stream `stream` of that rank's device (the raw handle of
/// [`Driver::stream_handle`](super::Driver::stream_handle)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Part {
    pub(crate) stream: u64,
    pub(crate) buffer: DevicePtr,
    pub(crate) count: usize,
    pub(crate) dtype: DType,
    pub(crate) kind: CollectiveKind,
}

/// Communicators over several devices, one rank each: what queues collectives among them.
/// Dropping it destroys them; the caller keeps it alive until every collective queued on it has
/// completed.
pub(crate) trait Communicators: Send + Sync {
    /// Opens a group: the parts added to it up to its [`end`](Group::end) are launched together.
    /// A group is ended exactly once, by `end` or, should it be dropped (a panic between its
    /// start and its end), by its drop, as NCCL requires of every group it opened.
    fn group(&self) -> Result<Box<dyn Group + '_>, Error>;
}

/// An open group of one collective: one part per rank, then the end that launches them.
pub(crate) trait Group {
    /// Adds rank `rank`'s part. A refusal leaves the group open: it is still ended, and the
    /// other ranks' parts may be launched by the end.
    ///
    /// # Safety
    /// The buffer holds `part.count` elements of `part.dtype` on rank `rank`'s device, and stays
    /// allocated and untouched by other work until the part has completed on `part.stream`, a
    /// compute stream of that device (in the engine's context).
    unsafe fn queue(&mut self, rank: usize, part: &Part) -> Result<(), Error>;

    /// Closes the group and launches its parts.
    fn end(self: Box<Self>) -> Result<(), Error>;
}

/// The size of a communicator's unique id (`ncclUniqueId`).
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

/// Making communicators: the driver of one of the devices makes them for all.
pub(crate) trait Collectives {
    /// A fresh unique id for a communicator whose ranks join it one by one, in processes of
    /// their own (`ncclGetUniqueId`), with the version of the library that made it (NCCL's
    /// version code; 0 for the simulator). Other processes learn the id from its bytes.
    ///
    /// # Errors
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) without a collective
    /// library, [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when it refuses.
    fn unique_id(&self) -> Result<(u32, [u8; UNIQUE_ID_BYTES]), Error>;

    /// The communicator of rank `rank` of a world of `world` ranks that join one by one, each
    /// in its own process (`ncclCommInitRank`), on this driver's device, through `id` (made by
    /// [`unique_id`](Self::unique_id) in one of them, by the library of version `library`).
    /// It has one rank here, index 0 of its groups; its parts' ranks are the world's. Returns
    /// once every rank has joined, or fails once `timeout` has passed without them (the
    /// communicator begun is aborted).
    ///
    /// # Errors
    /// As [`unique_id`](Self::unique_id);
    /// [`BootstrapError::UniqueId`](crate::error::BootstrapError::UniqueId) for an id of
    /// another library version than this driver's;
    /// [`BootstrapError::Unjoined`](crate::error::BootstrapError::Unjoined) when the world did
    /// not form in time; the library's error for an id it cannot use.
    fn join(
        &self,
        id: &[u8; UNIQUE_ID_BYTES],
        library: u32,
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    ) -> Result<Box<dyn Communicators>, Error>;

    /// Communicators over `devices`, rank `i` being `devices[i]`, each a device this driver's
    /// machine reaches. The caller has checked that they are distinct and reachable.
    ///
    /// # Errors
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) without a collective
    /// library, [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when it refuses.
    fn communicators(&self, devices: &[DeviceId]) -> Result<Box<dyn Communicators>, Error>;
}

/// The refusal of an id made by the collective library of version `made`, by one of version
/// `here`.
pub(crate) fn other_library(made: u32, here: u32) -> Error {
    crate::error::BootstrapError::UniqueId {
        reason: format!("made by collective library version {made}, where this process has {here}"),
    }
    .into()
}

/// The version of the collective library a GPU uses (NCCL), as `(major, minor, patch)`.
///
/// # Errors
/// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) when it cannot be loaded.
pub(crate) fn library_version() -> Result<(u32, u32, u32), Error> {
    super::cuda::nccl_version()
}
