//! The collective half of the device seam: communicators over several devices, and the group of
//! calls that queues a collective on every rank's stream.
//!
//! Collectives follow NCCL's model, whatever runs them. A set of [`Communicators`] joins devices,
//! one rank each, in a given order ([`Collectives::communicators`]), or holds one rank of a
//! world whose other ranks join from processes of their own ([`Collectives::join`]). One
//! operation is a group: [`Communicators::group`] opens it, calls for each rank
//! ([`Group::queue`]: all-reduce, broadcast, reduce, all-gather, reduce-scatter, send, receive)
//! add that rank's part on its stream, and [`Group::end`] launches them together, so that one
//! thread drives every device; the group's type ends it exactly once on every path. A rank's
//! collective calls run once every rank's have reached their streams' heads; a send meets its
//! peer's receive.
//!
//! The failure modes are NCCL's too, and the caller must allow for all of them: a call inside a
//! group may be refused, and the group is still ended; the end may fail; and once a group
//! has started, a failure does not say which ranks' parts were launched. A part launched without
//! its partners can never complete as a collective. So after any failure past the group's start
//! every rank's buffer must be treated as in use by the device until an event recorded after the
//! group on that rank's stream proves otherwise. A world with ranks elsewhere adds two: a peer
//! may never queue its part, which then waits for ever, and the library may find the
//! communicator failed. [`Communicators::health`] asks the second, and
//! [`Communicators::abort`] ends the parts of both.
//!
//! A real device uses NCCL, loaded at run time: `ncclCommInitAll` for the ranks of one process,
//! the non-blocking `ncclCommInitRankConfig` for a joined rank. The simulated machine runs the
//! collectives itself, with NCCL's rank rules, and fault injection for each call: a part refused
//! inside a group leaves the other ranks' parts launched, which the simulator then fails on
//! their streams (as an aborted communicator's kernels would end) instead of leaving them
//! waiting for ever, and the failure is what the next event recorded after the part on that
//! stream reports.

use super::DevicePtr;
use crate::device::DeviceId;
use crate::dtype::DType;
use crate::error::Error;

/// What one call of a collective does with its rank's buffers. `count` is the count NCCL's call
/// takes (see [`extents`](Self::extents) for what each buffer holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CollectiveKind {
    /// Every rank's output becomes the element-wise reduction of every rank's input.
    AllReduce(Reduction),
    /// Every rank's output becomes a copy of rank `root`'s input.
    Broadcast {
        /// The rank whose input is copied.
        root: usize,
    },
    /// Rank `root`'s output becomes the element-wise reduction of every rank's input; the
    /// other ranks' outputs are untouched.
    Reduce {
        /// How elements combine.
        op: Reduction,
        /// The rank that receives the reduction.
        root: usize,
    },
    /// Every rank's output (`count` elements per rank) becomes every rank's input, in rank
    /// order.
    AllGather,
    /// Rank `r`'s output (`count` elements) becomes the element-wise reduction of the `r`-th
    /// `count` elements of every rank's input.
    ReduceScatter(Reduction),
    /// The input goes to rank `peer`, whose matching [`Recv`](Self::Recv) receives it.
    Send {
        /// The receiving rank.
        peer: usize,
    },
    /// The output receives what rank `peer`'s matching [`Send`](Self::Send) sends.
    Recv {
        /// The sending rank.
        peer: usize,
    },
}

impl CollectiveKind {
    /// The elements read from the input and written to the output, for `count` (the call's
    /// count) in a world of `world` ranks. (The simulated machine checks and runs calls by it.)
    #[cfg(feature = "sim")]
    pub(crate) fn extents(self, count: usize, world: usize) -> (usize, usize) {
        match self {
            CollectiveKind::AllReduce(_)
            | CollectiveKind::Broadcast { .. }
            | CollectiveKind::Reduce { .. } => (count, count),
            CollectiveKind::AllGather => (count, count.saturating_mul(world)),
            CollectiveKind::ReduceScatter(_) => (count.saturating_mul(world), count),
            CollectiveKind::Send { .. } => (count, 0),
            CollectiveKind::Recv { .. } => (0, count),
        }
    }

    /// NCCL's name for the call.
    pub(crate) fn call(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce(_) => "ncclAllReduce",
            CollectiveKind::Broadcast { .. } => "ncclBroadcast",
            CollectiveKind::Reduce { .. } => "ncclReduce",
            CollectiveKind::AllGather => "ncclAllGather",
            CollectiveKind::ReduceScatter(_) => "ncclReduceScatter",
            CollectiveKind::Send { .. } => "ncclSend",
            CollectiveKind::Recv { .. } => "ncclRecv",
        }
    }

    /// Whether it is a point-to-point call, matched with its peer's rather than with every
    /// rank's.
    #[cfg(feature = "sim")]
    pub(crate) fn is_p2p(self) -> bool {
        matches!(
            self,
            CollectiveKind::Send { .. } | CollectiveKind::Recv { .. }
        )
    }
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

/// One call of a rank's part of a collective: `count` (NCCL's count) elements of `dtype`, read
/// from `send` and written to `recv` as [`CollectiveKind::extents`] says (the same address for
/// a call in place; unused for a send's output or a receive's input), on the compute stream
/// `stream` of that rank's device (the raw handle of
/// [`Driver::stream_handle`](super::Driver::stream_handle)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Part {
    pub(crate) stream: u64,
    pub(crate) send: DevicePtr,
    pub(crate) recv: DevicePtr,
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
    /// The group's end waits at most `timeout` for the library to queue its parts (a
    /// non-blocking communicator connecting to a peer), then fails with
    /// [`PeerError::CollectiveTimedOut`](crate::error::PeerError::CollectiveTimedOut) after aborting
    /// the communicators.
    fn group(&self, timeout: std::time::Duration) -> Result<Box<dyn Group + '_>, Error>;

    /// Whether some of the ranks are in other processes (a communicator joined one by one):
    /// a rank there may die or never queue its part, so waits on these communicators' work
    /// watch their [`health`](Self::health) and a deadline.
    fn watched(&self) -> bool;

    /// The communicators' asynchronous state (`ncclCommGetAsyncError`): `Ok` while they work,
    /// the failure once one has failed (they must then be aborted).
    ///
    /// # Errors
    /// The library's error for a communicator that failed;
    /// [`PeerError::Aborted`](crate::error::PeerError::Aborted) once aborted.
    fn health(&self) -> Result<(), Error>;

    /// Aborts the communicators (`ncclCommAbort`), once: every part queued on them ends on its
    /// stream without its partners, leaving its buffers as they are, and every later group is
    /// refused ([`PeerError::Aborted`](crate::error::PeerError::Aborted)). Safe to
    /// call from any thread, with or without work queued; the second call does nothing.
    fn abort(&self);
}

/// An open group of one collective: one part per rank, then the end that launches them.
pub(crate) trait Group {
    /// Adds a call to rank `rank`'s part (a rank's calls keep their order; point-to-point calls
    /// match their peer's in order). A refusal leaves the group open: it is still ended, and the
    /// other calls may be launched by the end.
    ///
    /// # Safety
    /// The buffers hold what [`CollectiveKind::extents`] says, in elements of `part.dtype`, on
    /// rank `rank`'s device, and stay allocated and untouched by other work until the part has
    /// completed on `part.stream`, a compute stream of that device (in the engine's context).
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
    /// [`MalformedError::UniqueId`](crate::error::MalformedError::UniqueId) for an id of
    /// another library version than this driver's;
    /// [`PeerError::Unjoined`](crate::error::PeerError::Unjoined) when the world did
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
    crate::error::MalformedError::UniqueId {
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
