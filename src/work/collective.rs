//! Collectives across engines through NCCL: all-reduce and broadcast over one engine per GPU.
//!
//! A [`Communicator`] joins engines on distinct devices, one NCCL rank each, in the order given.
//! [`all_reduce`] and [`broadcast`] take one tensor per rank by value, queue the collective on
//! every rank's compute stream (in one NCCL group, so one thread drives every GPU), record an
//! event after it on each, and return a [`Pending<Collective<T>>`](Pending): an operation in
//! flight like every other ([`crate::pending`]), with its verbs and rules:
//!
//! - a refused call hands the tensors back, in rank order ([`SubmitError`]);
//! - each rank's tensor is lent shared, for work on its own engine that the engine orders after
//!   the collective ([`tensor`](Pending::tensor));
//! - [`is_ready`](Pending::is_ready), [`wait`](Pending::wait), [`try_wait`](Pending::try_wait)
//!   and `.await` cover every rank; once returned, [`resubmit`](Pending::resubmit) queues the
//!   same collective again with the same events;
//! - dropping it in flight detaches each tensor into its own engine's retirement queue,
//!   released once that engine's event proves its part complete; `mem::forget` leaks them;
//! - a wait that fails retains the failing rank's tensor for its engine's lifetime.
//!
//! The communicators live as long as the [`Communicator`] and every collective queued on them,
//! and are destroyed after the last of those. NCCL is loaded at run time (`libnccl.so.2`, then
//! `libnccl.so`, or the file `CUFERRY_NCCL` names); without it the calls are a typed
//! [`SetupError::Unavailable`](crate::error::SetupError::Unavailable). On a simulated machine (engines of one
//! [`SimDevice`](crate::sim::SimDevice), feature `sim`) the device itself runs the collective,
//! every rank's part together once each has reached the head of its stream, so the same
//! lifecycle is tested without a GPU.
//!
//! Ranks in processes of their own join one by one: [`Communicator::join`] (`ncclCommInitRank`)
//! with rank 0's [`UniqueId`], handed over by the [`bootstrap`] module's [`Rendezvous`] or an
//! exchange of the caller's. Each such communicator holds one rank, this process's engine.

// A refused call hands its tensors back by value (see `routes::pending`).
#![allow(clippy::result_large_err)]

pub mod bootstrap;
mod ranks;

use crate::core::engine::CudaEngine;
use crate::core::order::Use;
use crate::driver::Lane;
use crate::driver::collective::{self as seam, CollectiveKind, Communicators, Group, Reduction};
use crate::error::SubmitError;
use crate::error::{DeviceId, Error, Result, SetupError, UsageError};
use crate::lifecycle::fence::{Fencing, IdleEvent, fence};
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
use crate::routes::pending::{self, InFlight, Operation, Pending, Returned};
pub use bootstrap::{DEFAULT_RENDEZVOUS_TIMEOUT, Launch, Rendezvous, UniqueId};

/// How long [`Communicator::join`] waits for every rank of its world: as long as a
/// rendezvous's default, for ranks that start at different times.
pub const DEFAULT_JOIN_TIMEOUT: std::time::Duration = DEFAULT_RENDEZVOUS_TIMEOUT;
use ranks::{Part, Ranks, RanksLanded};
use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::Arc;

mod sealed {
    pub trait Sealed {}
}

/// An element type NCCL reduces and broadcasts: the integers of 8, 32 and 64 bits, `f16`,
/// `bf16`, `f32` and `f64`. Sealed.
pub trait CollectiveElement: Element + sealed::Sealed {}

macro_rules! collective_element {
    ($($t:ty),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl CollectiveElement for $t {}
    )*};
}

collective_element!(i8, u8, i32, u32, i64, u64, half::f16, f32, f64, half::bf16);

/// How [`all_reduce`] combines the ranks' elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The product.
    Prod,
    /// The largest.
    Max,
    /// The smallest.
    Min,
    /// The mean (the sum divided by the number of ranks).
    Avg,
}

impl ReduceOp {
    /// The device's name for it.
    fn reduction(self) -> Reduction {
        match self {
            ReduceOp::Sum => Reduction::Sum,
            ReduceOp::Prod => Reduction::Prod,
            ReduceOp::Max => Reduction::Max,
            ReduceOp::Min => Reduction::Min,
            ReduceOp::Avg => Reduction::Avg,
        }
    }
}

/// The communicators of one [`Communicator`], destroyed when the last collective queued on
/// them and the communicator itself are gone.
struct Comms {
    /// What queues the collectives: NCCL's communicators on GPUs, the simulated machine's own.
    seam: Box<dyn Communicators>,
    /// Each rank's engine here: its device and id.
    members: Vec<(DeviceId, u64)>,
    /// The world's ranks, in this process and others.
    world: usize,
    /// The world's rank of `members[0]` (the others follow it).
    first_rank: usize,
}

/// NCCL communicators over engines on distinct devices, one rank per engine, in the order the
/// engines were given.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use cuferry::collective::{all_reduce, Communicator, ReduceOp};
/// use cuferry::{upload_tensor, CudaEngine};
/// let (mut gpu0, mut gpu1) = (CudaEngine::open(0)?, CudaEngine::open(1)?);
/// let comm = Communicator::new(&mut [&mut gpu0, &mut gpu1])?;
/// let a = upload_tensor(&mut gpu0, &[1.0f32, 2.0], &[2])?;
/// let b = upload_tensor(&mut gpu1, &[10.0f32, 20.0], &[2])?;
/// let summed = all_reduce(&comm, &mut [&mut gpu0, &mut gpu1], vec![a, b], ReduceOp::Sum)?;
/// let [a, b]: [_; 2] = summed.wait()?.into_parts().try_into().unwrap();
/// assert_eq!(cuferry::download_tensor(&mut gpu1, &b)?, [11.0, 22.0]);
/// # drop(a); Ok(()) }
/// ```
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<Comms>,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("ranks", &self.inner.members.len())
            .finish()
    }
}

impl Communicator {
    /// One NCCL communicator per engine (`ncclCommInitAll`), rank `i` being `engines[i]`; for
    /// engines of one simulated machine, the machine's own communicators.
    ///
    /// # Errors
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) without NCCL; [`SetupError::Unreachable`](crate::error::SetupError::Unreachable) for engines of different
    /// simulated machines, or real and simulated engines together; [`UsageError::NoEngines`](crate::error::UsageError::NoEngines)
    /// for no engines, [`UsageError::TwoRanksOnOneDevice`](crate::error::UsageError::TwoRanksOnOneDevice)
    /// for two on one device (ranks are devices); [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when NCCL
    /// refuses.
    pub fn new(engines: &mut [&mut CudaEngine]) -> Result<Communicator> {
        let Some(first) = engines.first().map(|e| e.device()) else {
            return Err(Error::Usage(UsageError::NoEngines {
                operation: "Communicator::new",
            }));
        };
        let mut members: Vec<(DeviceId, u64)> = Vec::with_capacity(engines.len());
        for engine in engines.iter() {
            let device = engine.device();
            if let Err(reason) = crate::driver::reachable(first, device) {
                return Err(Error::Setup(SetupError::Unreachable {
                    from: first,
                    to: device,
                    reason,
                }));
            }
            if members.iter().any(|&(d, _)| d == device) {
                return Err(Error::Usage(UsageError::TwoRanksOnOneDevice { device }));
            }
            members.push((device, engine.shared.engine_id));
        }
        let devices: Vec<DeviceId> = members.iter().map(|&(d, _)| d).collect();
        let seam = engines[0].shared.enter()?.driver.communicators(&devices)?;
        let world = members.len();
        Ok(Communicator {
            inner: Arc::new(Comms {
                seam,
                members,
                world,
                first_rank: 0,
            }),
        })
    }

    /// Joins rank `rank` of a world of `world` ranks, each in a process of its own (or a thread
    /// of its own), with `engine` as this rank's (`ncclCommInitRank`): every rank calls it with
    /// the same `id` (rank 0's [`UniqueId`], handed over by a [`Rendezvous`] or your own
    /// exchange). Returns once every rank has joined, waiting at most
    /// [`DEFAULT_JOIN_TIMEOUT`]; [`join_within`](Self::join_within) sets another deadline.
    ///
    /// The communicator holds one rank here: a collective on it takes this engine and one
    /// tensor (`&mut [&mut engine]`, `vec![tensor]`), and every other rank must make the same
    /// call, with the same length and element type, in the same order.
    ///
    /// # Errors
    /// [`BootstrapError::Rank`](crate::error::BootstrapError::Rank) for a rank at or above the
    /// world size; [`BootstrapError::UniqueId`](crate::error::BootstrapError::UniqueId) for an
    /// id made by another version of NCCL than this process loads;
    /// [`BootstrapError::Unjoined`](crate::error::BootstrapError::Unjoined) when the world did
    /// not form by the deadline (the join begun is aborted, and the engine works on);
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) without NCCL;
    /// [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when NCCL refuses (an id it
    /// cannot use, a rank given twice).
    pub fn join(
        engine: &mut CudaEngine,
        id: &UniqueId,
        rank: usize,
        world: usize,
    ) -> Result<Communicator> {
        Communicator::join_within(engine, id, rank, world, DEFAULT_JOIN_TIMEOUT)
    }

    /// As [`join`](Self::join), waiting at most `timeout` for the world to form. The join is
    /// non-blocking inside NCCL (2.14 and later; an older NCCL joins blocking, with no
    /// deadline), so a rank that never comes ends the wait, not the process.
    ///
    /// # Errors
    /// As [`join`](Self::join).
    pub fn join_within(
        engine: &mut CudaEngine,
        id: &UniqueId,
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    ) -> Result<Communicator> {
        if world == 0 || rank >= world {
            return Err(crate::error::BootstrapError::Rank { rank, world }.into());
        }
        let seam = engine.shared.enter()?.driver.join(
            id.raw(),
            id.library_version(),
            rank,
            world,
            timeout,
        )?;
        let members = vec![(engine.device(), engine.shared.engine_id)];
        Ok(Communicator {
            inner: Arc::new(Comms {
                seam,
                members,
                world,
                first_rank: rank,
            }),
        })
    }

    /// The number of ranks in this process (all of the world's, for [`new`](Self::new); one,
    /// for [`join`](Self::join)).
    pub fn ranks(&self) -> usize {
        self.inner.members.len()
    }

    /// The number of ranks in the world, here and in other processes.
    pub fn world(&self) -> usize {
        self.inner.world
    }

    /// The world's rank of this process's first rank (0 for [`new`](Self::new)).
    pub fn rank(&self) -> usize {
        self.inner.first_rank
    }

    /// The version of the NCCL library loaded, as `(major, minor, patch)`.
    ///
    /// # Errors
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) without NCCL.
    pub fn nccl_version() -> Result<(u32, u32, u32)> {
        seam::library_version()
    }
}

/// The operation of [`all_reduce`] and [`broadcast`]: one collective over every rank's tensor.
/// Its [parts](Operation::Parts) are the tensors, in rank order.
///
/// In flight it owns the tensors and lends each only shared, to work on its own engine
/// ([`tensor`](Pending::tensor)); [`wait`](Pending::wait) proves every rank's part complete.
/// Dropping it in flight detaches each tensor into its own engine's retirement queue.
pub struct Collective<T: Element>(PhantomData<fn() -> T>);

impl<T: Element> std::fmt::Debug for Collective<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Collective").field(&T::DTYPE).finish()
    }
}

impl<T: Element> pending::sealed::Sealed for Collective<T> {}

impl<T: Element> Operation for Collective<T> {
    type Parts = Vec<DeviceTensor<T>>;
    type Flight = Ranks<T>;
    type Landed = RanksLanded<T>;
    const NAME: &'static str = "collective";

    fn land(done: RanksLanded<T>) -> RanksLanded<T> {
        done
    }

    fn into_parts(landed: RanksLanded<T>) -> Vec<DeviceTensor<T>> {
        landed.tensors
    }
}

impl<T: Element> Pending<Collective<T>, InFlight> {
    /// Rank `rank`'s tensor, for work on its own engine: that engine orders it after the
    /// collective (on another of its streams, by an event wait on the device), with no host
    /// wait. `None` past the last rank.
    pub fn tensor(&self, rank: usize) -> Option<&DeviceTensor<T>> {
        self.hold.parts.get(rank).map(|part| match part {
            Part::Fenced(fenced) => &fenced.resources().0,
            Part::Done(tensor) => tensor,
        })
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.hold.parts.len()
    }
}

impl<T: Element> Pending<Collective<T>, Returned> {
    /// Rank `rank`'s tensor; `None` past the last rank.
    pub fn tensor(&self, rank: usize) -> Option<&DeviceTensor<T>> {
        self.hold.tensors.get(rank)
    }

    /// Every rank's tensor, in rank order.
    pub fn tensors(&self) -> &[DeviceTensor<T>] {
        &self.hold.tensors
    }

    /// Every rank's tensor, mutably: rewrite them (the next step's gradients, say) before
    /// [`resubmit`](Self::resubmit)ting. A tensor swapped for one of another engine or length is
    /// refused by the resubmission, which hands every tensor back.
    pub fn tensors_mut(&mut self) -> &mut [DeviceTensor<T>] {
        &mut self.hold.tensors
    }
}

impl<T: CollectiveElement> Pending<Collective<T>, Returned> {
    /// Queues the same collective again (the same reduction or root, over the same
    /// communicator), on the same tensors, reusing each rank's event: for a training loop that
    /// reduces the same gradients every step (rewrite them through
    /// [`tensors_mut`](Self::tensors_mut)). `engines[i]` is rank `i`'s engine. No event and no
    /// device memory is allocated; the per-rank lists of the submission (one entry per rank) are
    /// made again, as on the first submission.
    ///
    /// # Errors
    /// As [`all_reduce`].
    pub fn resubmit(self, engines: &mut [&mut CudaEngine]) -> Submitted<T> {
        let RanksLanded {
            tensors,
            events,
            comms,
            kind,
        } = self.hold;
        submit(&comms, engines, tensors, kind, events)
    }
}

type Submitted<T> = Result<Pending<Collective<T>>, SubmitError<Vec<DeviceTensor<T>>>>;

/// What the collective does on each rank.
#[derive(Clone, Copy, Debug)]
enum Kind {
    AllReduce(ReduceOp),
    Broadcast(usize),
}

/// Sums (or otherwise reduces, by `op`) every rank's tensor, element by element, into every
/// rank's tensor, in place: `tensors[i]` is rank `i`'s, of `engines[i]`.
///
/// # Errors
/// [`SubmitError::Rejected`] (the tensors back, untouched, in rank order) for a count of engines
/// or tensors other than the ranks, lengths that differ, an engine that is not the rank's or a
/// tensor not of its rank's engine, or a zero length; [`SubmitError::Failed`] (the tensors back)
/// when an engine could not order the collective after its earlier work, or the collective
/// library refused to open its group, before any of it was queued; [`SubmitError::Retained`]
/// when the library refused a rank's part or the group's end, or an event could not be fenced,
/// after parts of it may have been launched: every rank's tensor is then held by its engine
/// until that engine proves its stream complete (retained for good where it cannot, as when a
/// part launched without its partners fails), never freed under the device.
pub fn all_reduce<T: CollectiveElement>(
    comm: &Communicator,
    engines: &mut [&mut CudaEngine],
    tensors: Vec<DeviceTensor<T>>,
    op: ReduceOp,
) -> Submitted<T> {
    submit(
        &comm.inner,
        engines,
        tensors,
        Kind::AllReduce(op),
        Vec::new(),
    )
}

/// Copies rank `root`'s tensor into every other rank's, in place: `tensors[i]` is rank `i`'s,
/// of `engines[i]`.
///
/// # Errors
/// As [`all_reduce`], and [`SubmitError::Rejected`] for a root past the last rank.
pub fn broadcast<T: CollectiveElement>(
    comm: &Communicator,
    engines: &mut [&mut CudaEngine],
    tensors: Vec<DeviceTensor<T>>,
    root: usize,
) -> Submitted<T> {
    submit(
        &comm.inner,
        engines,
        tensors,
        Kind::Broadcast(root),
        Vec::new(),
    )
}

/// Why a collective over `tensors` on `engines` is refused, if it is.
fn refusal<T: Element>(
    comms: &Comms,
    engines: &[&mut CudaEngine],
    tensors: &[DeviceTensor<T>],
    kind: Kind,
) -> Option<Error> {
    let ranks = comms.members.len();
    if engines.len() != ranks || tensors.len() != ranks {
        return Some(Error::Usage(UsageError::RankCount {
            ranks,
            engines: engines.len(),
            tensors: tensors.len(),
        }));
    }
    if let Kind::Broadcast(root) = kind
        && root >= comms.world
    {
        return Some(Error::Usage(UsageError::RootOutOfRange {
            root,
            ranks: comms.world,
        }));
    }
    for ((engine, tensor), &(device, id)) in engines.iter().zip(tensors).zip(&comms.members) {
        if let Err(error) = engine
            .shared
            .check_owner(device, id)
            .and_then(|()| tensor.check_engine(engine))
        {
            return Some(error);
        }
    }
    let len = tensors[0].len();
    if len == 0 {
        return Some(Error::Usage(UsageError::ZeroLength {
            what: "a collective",
        }));
    }
    if let Some(other) = tensors.iter().find(|t| t.len() != len) {
        return Some(Error::Usage(UsageError::LengthMismatch {
            what: "collective: another rank's tensor for the first rank's",
            expected: len,
            found: other.len(),
            shape: None,
        }));
    }
    None
}

/// Queues every rank's part of the collective into `group`, and ends it. `Err` means that any
/// rank's part may have been launched.
///
/// # Safety
/// Each tensor holds `count` elements of `T` on its rank's device and stays allocated, and
/// untouched by other work, until its part has completed on its rank's stream, `streams[i]`,
/// the compute stream of that rank's engine.
unsafe fn queue_group<T: Element>(
    mut group: Box<dyn Group + '_>,
    streams: &[u64],
    tensors: &[DeviceTensor<T>],
    kind: Kind,
) -> Result<()> {
    let kind = match kind {
        Kind::AllReduce(op) => CollectiveKind::AllReduce(op.reduction()),
        Kind::Broadcast(root) => CollectiveKind::Broadcast { root },
    };
    let mut first = Ok(());
    for (rank, (&stream, tensor)) in streams.iter().zip(tensors).enumerate() {
        let part = seam::Part {
            stream,
            buffer: tensor.raw_ptr(),
            count: tensor.len(),
            dtype: T::DTYPE,
            kind,
        };
        // SAFETY: the caller's contract, for rank `rank`.
        let queued = unsafe { group.queue(rank, &part) };
        if first.is_ok() {
            first = queued;
        }
    }
    // Ended whatever happened inside, as NCCL requires.
    first.and(group.end())
}

/// Validates and queues the collective. `events` are the ranks' idle events on resubmission
/// (empty otherwise); on a refusal they go back to their engines' pools.
fn submit<T: CollectiveElement>(
    comms: &Arc<Comms>,
    engines: &mut [&mut CudaEngine],
    tensors: Vec<DeviceTensor<T>>,
    kind: Kind,
    events: Vec<Option<IdleEvent>>,
) -> Submitted<T> {
    if let Some(error) = refusal(comms, engines, &tensors, kind) {
        return Err(SubmitError::Rejected {
            input: tensors,
            error,
        });
    }
    // Each rank's compute stream first waits for the earlier work on its tensor (its engine's
    // other streams); the use is recorded, so the engine's later uses and free wait for the
    // collective.
    let mut streams = Vec::with_capacity(engines.len());
    for (engine, tensor) in engines.iter_mut().zip(&tensors) {
        let ordered = engine.shared.enter().and_then(|mut st| {
            st.order_uses(Lane::Compute, &[Use::Write(tensor.raw_ptr())])?;
            Ok(st.driver.stream_handle())
        });
        match ordered {
            Ok(stream) => streams.push(stream),
            // Nothing of the collective is queued: a recorded use only orders more than needed.
            Err(error) => {
                return Err(SubmitError::Failed {
                    input: tensors,
                    error,
                });
            }
        }
    }
    // Nothing of the collective is queued until its group has started.
    let group = match comms.seam.group() {
        Ok(group) => group,
        Err(error) => {
            return Err(SubmitError::Failed {
                input: tensors,
                error,
            });
        }
    };
    // SAFETY: the buffers hold their lengths' elements of `T` on their ranks' devices (checked
    // by `refusal`), the streams are the ranks' engines' compute streams, which waited for the
    // tensors' earlier uses above, and the tensors are fenced below before anything can release
    // them (and kept, never freed, where they cannot be).
    let queued = unsafe { queue_group(group, &streams, &tensors, kind) };
    // From here the device may touch every tensor: each is fenced on its engine.
    let mut parts = Vec::with_capacity(tensors.len());
    let mut failure = queued.err();
    let mut events = events.into_iter();
    for (engine, tensor) in engines.iter_mut().zip(tensors) {
        let owner = std::sync::Arc::clone(&engine.shared);
        let resources = ManuallyDrop::new((tensor, Arc::clone(comms)));
        let event = events.next().flatten();
        let mut st = match owner.enter() {
            Ok(st) => st,
            Err(error) => {
                // Without the context no event can be recorded and nothing can prove the part
                // complete.
                failure.get_or_insert(error);
                continue; // left in `ManuallyDrop`: leaked, never freed under the device
            }
        };
        match fence(
            &mut st,
            &owner,
            Lane::Compute,
            resources,
            event.map(IdleEvent::into_raw),
            "collective",
        ) {
            Fencing::Fenced(fenced) => parts.push(Part::Fenced(fenced)),
            Fencing::Proven((tensor, _comms), error) => {
                st.defer(error);
                parts.push(Part::Done(tensor));
            }
            Fencing::Untracked(untracked, error) => {
                drop(st);
                untracked.retain();
                failure.get_or_insert(error);
            }
        }
    }
    match failure {
        None => Ok(Pending::in_flight(Ranks {
            parts,
            comms: Arc::clone(comms),
            kind,
        })),
        Some(error) => {
            // Every fenced part detaches into its engine's queue as `parts` drops.
            drop(parts);
            Err(SubmitError::Retained { error })
        }
    }
}
