//! Collectives across engines through NCCL: all-reduce, broadcast, reduce, all-gather,
//! reduce-scatter, and sends and receives, alone or grouped, over one engine per GPU.
//!
//! A [`Communicator`] joins engines on distinct devices, one NCCL rank each, in the order given
//! ([`Communicator::new`]), or one rank of a world whose other ranks are processes of their own
//! ([`Communicator::join`]). Every collective is said one way: a [`CollectiveGroup`] made by
//! [`Communicator::group`], given calls ([`all_reduce`](CollectiveGroup::all_reduce),
//! [`broadcast`](CollectiveGroup::broadcast), [`reduce`](CollectiveGroup::reduce),
//! [`all_gather`](CollectiveGroup::all_gather),
//! [`reduce_scatter`](CollectiveGroup::reduce_scatter), [`send`](CollectiveGroup::send),
//! [`recv`](CollectiveGroup::recv)) that take this process's ranks' tensors by value, and
//! [submitted](CollectiveGroup::submit) with the ranks' engines, one call or several:
//! `comm.group().all_reduce(tensors, ReduceOp::Sum).submit(&mut engines)`. The submission
//! queues on every rank's compute stream in one NCCL group (so one thread drives every GPU),
//! records an event after it on each, and returns a
//! [`Pending<Collective<T>>`](Pending): an operation in flight like every other
//! ([`crate::pending`]), with its verbs and rules:
//!
//! - every call is checked on the calling rank before anything is queued (engines, lengths,
//!   roots, peers), and a refused one hands the tensors back, in the order given
//!   ([`SubmitError`]);
//! - each tensor is lent shared, for work on its own engine that the engine orders after the
//!   collective ([`tensor`](Pending::tensor));
//! - [`is_ready`](Pending::is_ready), [`wait`](Pending::wait), [`try_wait`](Pending::try_wait)
//!   and `.await` cover every rank; once returned, [`resubmit`](Pending::resubmit) queues the
//!   same calls again with the same events;
//! - dropping it in flight detaches each tensor into its own engine's retirement queue,
//!   released once that engine's event proves its part complete; `mem::forget` leaks them;
//! - a wait that fails retains the failing tensor for its engine's lifetime;
//! - for joined ranks, every wait also watches the communicator's state and a deadline
//!   ([`Communicator::with_timeout`]): a peer that died ends it with
//!   [`Error::Peer`](crate::Error::Peer), the communicator aborted and the
//!   tensors detached as on a drop.
//!
//! The communicators live as long as the [`Communicator`] and every collective queued on them,
//! and are destroyed after the last of those. NCCL is loaded at run time (`libnccl.so.2`, then
//! `libnccl.so`, or the file `CUFERRY_NCCL` names); without it the calls are a typed
//! [`SetupError::Unavailable`](crate::error::SetupError::Unavailable). On a simulated machine
//! (engines of one [`SimDevice`](crate::sim::SimDevice), feature `sim`) the device itself runs
//! the collectives, every rank's part together once each has reached the head of its stream,
//! and each send with its receive, so the same lifecycle is tested without a GPU.
//!
//! Ranks in processes of their own join one by one: [`Communicator::join`] (`ncclCommInitRank`)
//! with rank 0's [`UniqueId`], handed over by a [`Rendezvous`] or an exchange of the caller's,
//! or [`Launch::join`] for a launched process, whose one deadline
//! ([`Launch::with_timeout`]) the rendezvous, the join and the collectives inherit. Each such
//! communicator holds one rank, this process's engine. The guide's chapter [Running across processes](crate::guide::across_processes) is that path,
//! start to finish.

// A refused call hands its tensors back by value (see `lifecycle::pending`).
#![allow(clippy::result_large_err)]

mod bootstrap;
mod ranks;

use crate::core::engine::CudaEngine;
use crate::core::order::Use;
use crate::device::DeviceId;
use crate::driver::Lane;
use crate::driver::collective::{
    self as seam, CollectiveKind, Communicators, Group as SeamGroup, Reduction,
};
use crate::error::SubmitError;
use crate::error::{Error, Result, SetupError, UsageError};
use crate::lifecycle::fence::{Fencing, IdleEvent, fence};
use crate::lifecycle::pending::{self, InFlight, Operation, Pending, Returned};
use crate::memory::element::Element;
use crate::memory::tensor::DeviceTensor;
pub use bootstrap::{
    DEFAULT_BOOTSTRAP_TIMEOUT, GREETING_GRACE, GREETING_PATIENCE, Launch, MAX_JOB_BYTES,
    MAX_LISTED_REFUSALS, MAX_UNGREETED, MAX_WORLD, Rendezvous, UniqueId,
};
use ranks::{Part, Ranks, RanksLanded};
use std::fmt;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// How a reduction ([`all_reduce`](CollectiveGroup::all_reduce),
/// [`reduce`](CollectiveGroup::reduce), [`reduce_scatter`](CollectiveGroup::reduce_scatter))
/// combines the ranks'
/// elements.
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
    /// The mean: the sum divided by the number of ranks. For integers, as NCCL computes it,
    /// the sum wraps in the element type before the division (two ranks' `200u8` are
    /// `400 mod 256 = 144`, halved `72`), and the quotient truncates toward zero; for floats
    /// the sum rounds to the element type at each step.
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

/// How long a collective over ranks in other processes may take, from its submission to the
/// proof that this rank's part completed, before its wait aborts the communicator: ten
/// minutes, as long as PyTorch's default for NCCL, for steps that wait on slow peers (a
/// checkpoint, a straggler) without calling them dead.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(600);

/// NCCL communicators over engines on distinct devices, one rank per engine, in the order the
/// engines were given ([`new`](Self::new)), or one rank of a world whose other ranks are in
/// other processes ([`join`](Self::join)).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use cuferry::collective::{Communicator, ReduceOp};
/// use cuferry::{upload_tensor, CudaEngine};
/// let (mut gpu0, mut gpu1) = (CudaEngine::open(0)?, CudaEngine::open(1)?);
/// let comm = Communicator::new(&mut [&mut gpu0, &mut gpu1])?;
/// let a = upload_tensor(&mut gpu0, &[1.0f32, 2.0], &[2])?;
/// let b = upload_tensor(&mut gpu1, &[10.0f32, 20.0], &[2])?;
/// let summed = comm
///     .group()
///     .all_reduce(vec![a, b], ReduceOp::Sum)
///     .submit(&mut [&mut gpu0, &mut gpu1])?;
/// let [a, b]: [_; 2] = summed.wait()?.into_parts().try_into().unwrap();
/// assert_eq!(cuferry::download_tensor(&mut gpu1, &b)?, [11.0, 22.0]);
/// # drop(a); Ok(()) }
/// ```
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<Comms>,
    /// The deadline of each collective submitted through this handle, for joined ranks.
    timeout: Duration,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("ranks", &self.inner.members.len())
            .field("world", &self.inner.world)
            .field("rank", &self.inner.first_rank)
            .finish()
    }
}

impl Communicator {
    fn from_comms(comms: Comms) -> Communicator {
        Communicator {
            inner: Arc::new(comms),
            timeout: DEFAULT_COLLECTIVE_TIMEOUT,
        }
    }

    /// One NCCL communicator per engine (`ncclCommInitAll`), rank `i` being `engines[i]`; for
    /// engines of one simulated machine, the machine's own communicators.
    ///
    /// # Errors
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) without NCCL;
    /// [`SetupError::Unreachable`](crate::error::SetupError::Unreachable) for engines of
    /// different simulated machines, or real and simulated engines together;
    /// [`UsageError::NoEngines`](crate::error::UsageError::NoEngines) for no engines,
    /// [`UsageError::TwoRanksOnOneDevice`](crate::error::UsageError::TwoRanksOnOneDevice) for
    /// two on one device (ranks are devices);
    /// [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when NCCL refuses.
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
        Ok(Communicator::from_comms(Comms {
            seam,
            members,
            world,
            first_rank: 0,
        }))
    }

    /// Joins rank `rank` of a world of `world` ranks, each in a process of its own (or a thread
    /// of its own), with `engine` as this rank's (`ncclCommInitRank`): every rank calls it with
    /// the same `id` (rank 0's [`UniqueId`], handed over by a [`Rendezvous`] or your own
    /// exchange). Returns once every rank has joined, waiting at most
    /// [`DEFAULT_BOOTSTRAP_TIMEOUT`]; a [`Launch`] sets another deadline for the join and the
    /// collectives ([`Launch::with_timeout`], [`Launch::join`]; [`Launch::new`] where no
    /// launcher set the variables). The join is non-blocking inside NCCL (2.14 and later; an
    /// older NCCL joins blocking, with no deadline), so a rank that never comes ends the wait,
    /// not the process.
    ///
    /// The communicator holds one rank here: a collective on it takes this engine and this
    /// rank's tensors (`&mut [&mut engine]`, `vec![tensor]`), and every other rank must make
    /// the same calls, with the same counts and element type, in the same order (NCCL does not
    /// check this: calls that differ hang until the [deadline](Self::with_timeout), or corrupt
    /// the results).
    ///
    /// # Errors
    /// [`UsageError::NotARank`](crate::error::UsageError::NotARank) for a rank at or above the
    /// world size; [`MalformedError::UniqueId`](crate::error::MalformedError::UniqueId) for an
    /// id made by another version of NCCL than this process loads;
    /// [`PeerError::Unjoined`](crate::error::PeerError::Unjoined) when the world did
    /// not form by the deadline (the join begun is aborted, and the engine works on), naming
    /// the ranks that never joined where the collective library can tell (the simulated
    /// device can; NCCL does not say);
    /// [`SetupError::Unavailable`](crate::error::SetupError::Unavailable) without NCCL;
    /// [`LibraryError::Vendor`](crate::error::LibraryError::Vendor) when NCCL refuses (an id it
    /// cannot use, a rank given twice).
    pub fn join(
        engine: &mut CudaEngine,
        id: &UniqueId,
        rank: usize,
        world: usize,
    ) -> Result<Communicator> {
        Communicator::join_by(engine, id, rank, world, DEFAULT_BOOTSTRAP_TIMEOUT)
    }

    /// As [`join`](Self::join), waiting at most `timeout` for the world to form
    /// (`Duration::MAX`: for ever): [`Launch::join`]'s.
    pub(crate) fn join_by(
        engine: &mut CudaEngine,
        id: &UniqueId,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Communicator> {
        if world == 0 || rank >= world {
            return Err(crate::error::UsageError::NotARank { rank, world }.into());
        }
        let seam = engine.shared.enter()?.driver.join(
            id.raw(),
            id.library_version(),
            rank,
            world,
            timeout,
        )?;
        let members = vec![(engine.device(), engine.shared.engine_id)];
        Ok(Communicator::from_comms(Comms {
            seam,
            members,
            world,
            first_rank: rank,
        }))
    }

    /// This handle with another deadline for the collectives submitted through it (the
    /// default is [`DEFAULT_COLLECTIVE_TIMEOUT`]). It counts from a collective's submission;
    /// a wait on a collective of [joined](Self::join) ranks that passes it aborts the
    /// communicator and fails with
    /// [`PeerError::CollectiveTimedOut`](crate::error::PeerError::CollectiveTimedOut). Collectives of
    /// [`new`](Self::new)'s communicators, whose ranks are all in this process, have no
    /// deadline: no peer can vanish. `Duration::MAX` (or any duration too large for a
    /// deadline) is no deadline for joined ranks too.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Communicator {
        self.timeout = timeout;
        self
    }

    /// The deadline of the collectives submitted through this handle.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Aborts the communicator (`ncclCommAbort`): its collectives still queued end without
    /// their peers, leaving their tensors' contents unspecified, and every later collective on
    /// it is refused with [`PeerError::Aborted`](crate::error::PeerError::Aborted),
    /// as is every wait on one in flight. For a rank that learns by other means that a peer is
    /// gone (its launcher said so), or that must leave a collective it will not wait for
    /// (dropped in flight) before its engine can synchronize. The tensors lent are released by
    /// their engines once the ended parts are proven complete. Every clone of this handle sees
    /// the abort; a second one does nothing.
    pub fn abort(&self) {
        self.inner.seam.abort();
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

    /// An empty group of collectives on this communicator, of one element type: the calls
    /// added to it are queued as one NCCL group, and are one operation in flight.
    pub fn group<T: CollectiveElement>(&self) -> CollectiveGroup<T> {
        CollectiveGroup {
            comm: self.clone(),
            plan: Plan::default(),
            tensors: Vec::new(),
            refusal: None,
        }
    }
}

/// The operation of every collective: one NCCL group over this process's ranks' tensors. Its
/// [parts](Operation::Parts) are the tensors of each call of its [`CollectiveGroup`], in the
/// order the calls were added, and each call's in the order it was given them: one per rank,
/// in rank order, for an all-reduce, a broadcast and a reduce; each rank's input and then each
/// rank's output for an all-gather and a reduce-scatter; the one tensor of a send or a
/// receive.
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
    /// Tensor `index` (in the order given: see [`Collective`]), for work on its own engine:
    /// that engine orders it after the collective (on another of its streams, by an event
    /// wait on the device), with no host wait. `None` past the last.
    pub fn tensor(&self, index: usize) -> Option<&DeviceTensor<T>> {
        self.hold.parts.get(index).map(|part| match part {
            Part::Fenced(fenced) => &fenced.resources().0,
            Part::Done(tensor) => tensor,
        })
    }

    /// The number of tensors the collective holds.
    pub fn tensor_count(&self) -> usize {
        self.hold.parts.len()
    }
}

impl<T: Element> Pending<Collective<T>, Returned> {
    /// Tensor `index` (in the order given); `None` past the last.
    pub fn tensor(&self, index: usize) -> Option<&DeviceTensor<T>> {
        self.hold.tensors.get(index)
    }

    /// Every tensor, in the order given.
    pub fn tensors(&self) -> &[DeviceTensor<T>] {
        &self.hold.tensors
    }

    /// Every tensor, mutably: rewrite them (the next step's gradients, say) before
    /// [`resubmit`](Self::resubmit)ting. A tensor swapped for one of another engine or length is
    /// refused by the resubmission, which hands every tensor back.
    pub fn tensors_mut(&mut self) -> &mut [DeviceTensor<T>] {
        &mut self.hold.tensors
    }
}

impl<T: CollectiveElement> Pending<Collective<T>, Returned> {
    /// Queues the same collective again (the same calls, over the same communicator, with the
    /// same deadline), on the same tensors, reusing each tensor's event: for a training loop
    /// that reduces the same gradients every step (rewrite them through
    /// [`tensors_mut`](Self::tensors_mut)). `engines[i]` is rank `i`'s engine. No event and no
    /// device memory is allocated.
    ///
    /// # Errors
    /// As [`CollectiveGroup::submit`].
    pub fn resubmit(self, engines: &mut [&mut CudaEngine]) -> Submitted<T> {
        let RanksLanded {
            tensors,
            events,
            comms,
            plan,
            timeout,
        } = self.hold;
        submit(&comms, timeout, engines, tensors, plan, events)
    }
}

/// What a collective's submission returns: the operation in flight, or the refusal with every
/// tensor back, in the order given.
pub type Submitted<T> = Result<Pending<Collective<T>>, SubmitError<Vec<DeviceTensor<T>>>>;

/// One call of a collective, for one rank here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    AllReduce(ReduceOp),
    Broadcast(usize),
    Reduce(ReduceOp, usize),
    AllGather,
    ReduceScatter(ReduceOp),
    Send(usize),
    Recv(usize),
}

impl Call {
    fn kind(self) -> CollectiveKind {
        match self {
            Call::AllReduce(op) => CollectiveKind::AllReduce(op.reduction()),
            Call::Broadcast(root) => CollectiveKind::Broadcast { root },
            Call::Reduce(op, root) => CollectiveKind::Reduce {
                op: op.reduction(),
                root,
            },
            Call::AllGather => CollectiveKind::AllGather,
            Call::ReduceScatter(op) => CollectiveKind::ReduceScatter(op.reduction()),
            Call::Send(peer) => CollectiveKind::Send { peer },
            Call::Recv(peer) => CollectiveKind::Recv { peer },
        }
    }
}

/// One call for one rank here: rank `rank` (of this process's) reads tensor `input` and
/// writes tensor `output` (indices into the operation's tensors; the same one for a call in
/// place). `call` numbers the builder's calls, whose steps (one per rank) belong together.
#[derive(Clone, Copy, Debug)]
struct Step {
    rank: usize,
    call: Call,
    input: usize,
    output: usize,
    id: usize,
}

/// What a collective runs: its steps, in order, and each tensor's rank here.
#[derive(Clone, Debug, Default)]
struct Plan {
    steps: Vec<Step>,
    owners: Vec<usize>,
    calls: usize,
}

/// A group of collectives and point-to-point calls on one communicator, of one element type,
/// queued together as one NCCL group (`ncclGroupStart`, the calls, `ncclGroupEnd`) and in
/// flight as one operation ([`Collective`]): the buckets of a step's gradients, or a ring of
/// sends and receives, which must be grouped for NCCL to match them without deadlock.
///
/// Each call takes its tensors by value; [`submit`](Self::submit) checks every call (their
/// ranks' engines, lengths, roots and peers) before anything is queued and hands every tensor
/// back, in the order given, when it refuses. The operation's tensors are in the order given,
/// each call's in the order its arguments list them.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # use cuferry::collective::{Communicator, UniqueId};
/// # use cuferry::{upload_tensor, CudaEngine};
/// # let mut engine = CudaEngine::open(0)?;
/// # let id = UniqueId::new(&engine)?;
/// # let comm = Communicator::join(&mut engine, &id, 0, 1)?;
/// // A ring: each rank sends its tensor to the next and receives the previous one's.
/// let (rank, world) = (comm.rank(), comm.world());
/// let mine = upload_tensor(&mut engine, &[rank as f32; 4], &[4])?;
/// let theirs = upload_tensor(&mut engine, &[0.0f32; 4], &[4])?;
/// let ring = comm
///     .group()
///     .send(0, mine, (rank + 1) % world)
///     .recv((rank + world - 1) % world, 0, theirs);
/// let [_mine, theirs]: [_; 2] = ring.submit(&mut [&mut engine])?.wait()?.into_parts().try_into().unwrap();
/// # drop(theirs); Ok(()) }
/// ```
pub struct CollectiveGroup<T: CollectiveElement> {
    comm: Communicator,
    plan: Plan,
    tensors: Vec<DeviceTensor<T>>,
    /// The first call given the wrong number of tensors, refused by the submission.
    refusal: Option<Error>,
}

impl<T: CollectiveElement> fmt::Debug for CollectiveGroup<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CollectiveGroup")
            .field("dtype", &T::DTYPE)
            .field("calls", &self.plan.calls)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl<T: CollectiveElement> CollectiveGroup<T> {
    /// Adds `tensor` as rank `rank`'s (of this process's) for a call, returning its index.
    fn push(&mut self, rank: usize, tensor: DeviceTensor<T>) -> usize {
        self.tensors.push(tensor);
        self.plan.owners.push(rank);
        self.tensors.len() - 1
    }

    /// Adds a call with one tensor per rank here, each read and written in place.
    fn in_place(&mut self, tensors: Vec<DeviceTensor<T>>, call: Call) {
        self.count_check(tensors.len());
        let id = self.next_id();
        for (rank, tensor) in tensors.into_iter().enumerate() {
            let at = self.push(rank, tensor);
            self.plan.steps.push(Step {
                rank,
                call,
                input: at,
                output: at,
                id,
            });
        }
    }

    /// Adds a call with an input and an output per rank here.
    fn exchange(
        &mut self,
        inputs: Vec<DeviceTensor<T>>,
        outputs: Vec<DeviceTensor<T>>,
        call: Call,
    ) {
        self.count_check(inputs.len());
        self.count_check(outputs.len());
        let id = self.next_id();
        let inputs: Vec<usize> = inputs
            .into_iter()
            .enumerate()
            .map(|(rank, t)| self.push(rank, t))
            .collect();
        let outputs: Vec<usize> = outputs
            .into_iter()
            .enumerate()
            .map(|(rank, t)| self.push(rank, t))
            .collect();
        for (rank, (&input, &output)) in inputs.iter().zip(&outputs).enumerate() {
            self.plan.steps.push(Step {
                rank,
                call,
                input,
                output,
                id,
            });
        }
    }

    /// Adds a send or a receive of one tensor of rank `rank` here.
    fn point_to_point(&mut self, rank: usize, tensor: DeviceTensor<T>, call: Call) {
        let id = self.next_id();
        let at = self.push(rank, tensor);
        self.plan.steps.push(Step {
            rank,
            call,
            input: at,
            output: at,
            id,
        });
    }

    fn next_id(&mut self) -> usize {
        self.plan.calls += 1;
        self.plan.calls - 1
    }

    /// Records the refusal of a call given `given` tensors (or ranks) where this process has
    /// another number of ranks.
    fn count_check(&mut self, given: usize) {
        let ranks = self.comm.ranks();
        if given != ranks && self.refusal.is_none() {
            self.refusal = Some(Error::Usage(UsageError::RankCount {
                ranks,
                engines: ranks,
                tensors: given,
            }));
        }
    }

    /// Adds an all-reduce: sums (or otherwise reduces, by `op`) every rank's tensor, element
    /// by element, into every rank's tensor, in place. `tensors[i]` is rank `i`'s (of this
    /// process's), of the engine given as `engines[i]` to [`submit`](Self::submit). Every rank
    /// of the world calls it with the same length.
    #[must_use]
    pub fn all_reduce(mut self, tensors: Vec<DeviceTensor<T>>, op: ReduceOp) -> Self {
        self.in_place(tensors, Call::AllReduce(op));
        self
    }

    /// Adds a broadcast: copies world rank `root`'s tensor into every other rank's, in place
    /// (`tensors`: one per rank here, in rank order). Every rank of the world calls it with the
    /// same length and root; the submission refuses a root past the world's last rank.
    #[must_use]
    pub fn broadcast(mut self, tensors: Vec<DeviceTensor<T>>, root: usize) -> Self {
        self.in_place(tensors, Call::Broadcast(root));
        self
    }

    /// Adds a reduction of every rank's tensor by `op` into world rank `root`'s, in place
    /// (`tensors`: one per rank here); the other ranks' tensors are left as they were. Every
    /// rank of the world calls it with the same length, op and root.
    #[must_use]
    pub fn reduce(mut self, tensors: Vec<DeviceTensor<T>>, op: ReduceOp, root: usize) -> Self {
        self.in_place(tensors, Call::Reduce(op, root));
        self
    }

    /// Adds an all-gather of every rank's input into every rank's output, in world rank order
    /// (one of each per rank here): each output holds the world's size times its input's
    /// length (NCCL writes that many elements, so the submission refuses a shorter output,
    /// before anything is queued). Every rank of the world calls it with the same input length.
    /// The call's tensors are the inputs, then the outputs.
    #[must_use]
    pub fn all_gather(
        mut self,
        inputs: Vec<DeviceTensor<T>>,
        outputs: Vec<DeviceTensor<T>>,
    ) -> Self {
        self.exchange(inputs, outputs, Call::AllGather);
        self
    }

    /// Adds a reduce-scatter: reduces every rank's input by `op` and scatters the result, world
    /// rank `r`'s output getting the `r`-th of the world's size equal slices (one input and one
    /// output per rank here). Each input holds the world's size times its output's length
    /// (refused otherwise). Every rank of the world calls it with the same output length. The
    /// call's tensors are the inputs, then the outputs.
    #[must_use]
    pub fn reduce_scatter(
        mut self,
        inputs: Vec<DeviceTensor<T>>,
        outputs: Vec<DeviceTensor<T>>,
        op: ReduceOp,
    ) -> Self {
        self.exchange(inputs, outputs, Call::ReduceScatter(op));
        self
    }

    /// Adds a send of `tensor`, from rank `rank` of this process's (0 for a
    /// [joined](Communicator::join) rank), to world rank `peer`, which must add a matching
    /// [`recv`](Self::recv) (same length and element type; sends to one peer meet its receives
    /// from this rank in order). Source first: the rank and its tensor, then the peer.
    #[must_use]
    pub fn send(mut self, rank: usize, tensor: DeviceTensor<T>, peer: usize) -> Self {
        self.point_to_point(rank, tensor, Call::Send(peer));
        self
    }

    /// Adds a receive from world rank `peer`, which must add a matching [`send`](Self::send),
    /// into `tensor`, on rank `rank` of this process's. Source first: the peer, then the rank
    /// and its tensor.
    #[must_use]
    pub fn recv(mut self, peer: usize, rank: usize, tensor: DeviceTensor<T>) -> Self {
        self.point_to_point(rank, tensor, Call::Recv(peer));
        self
    }

    /// The number of calls added.
    pub fn len(&self) -> usize {
        self.plan.calls
    }

    /// Whether no call was added.
    pub fn is_empty(&self) -> bool {
        self.plan.calls == 0
    }

    /// Checks every call and queues them as one NCCL group: `engines[i]` is rank `i`'s (of
    /// this process's) engine.
    ///
    /// # Errors
    /// [`SubmitError::Rejected`] (the tensors back, untouched, in the order given) for an empty
    /// group, a count of engines or tensors other than this process's ranks, lengths that
    /// differ across the ranks of a call, an engine that is not the rank's or a tensor not of
    /// its rank's engine, a zero length, a root or a peer past the world's last rank, or an
    /// all-gather's output (a reduce-scatter's input) that is not the world's size times its
    /// other tensor's length;
    /// [`SubmitError::Failed`] (the tensors back) when an engine could not order the collective
    /// after its earlier work, or the collective library refused to open its group (for an
    /// aborted communicator,
    /// [`PeerError::Aborted`](crate::error::PeerError::Aborted)), before any of it
    /// was queued; [`SubmitError::Retained`] when the library refused a rank's part or the
    /// group's end, or an event could not be fenced, after parts of it may have been launched:
    /// every tensor is then held by its engine until that engine proves its stream complete
    /// (retained for good where it cannot, as when a part launched without its partners fails),
    /// never freed under the device; a [joined](Communicator::join) rank's communicator is then
    /// aborted (NCCL leaves it unusable), and later collectives on it are refused with
    /// [`PeerError::Aborted`](crate::error::PeerError::Aborted).
    pub fn submit(self, engines: &mut [&mut CudaEngine]) -> Submitted<T> {
        let CollectiveGroup {
            comm,
            plan,
            tensors,
            refusal,
        } = self;
        if let Some(error) = refusal {
            return Err(SubmitError::Rejected {
                input: tensors,
                error,
            });
        }
        submit(
            &comm.inner,
            comm.timeout,
            engines,
            tensors,
            Arc::new(plan),
            Vec::new(),
        )
    }
}

/// Why a collective over `tensors` on `engines` is refused, if it is.
fn refusal<T: Element>(
    comms: &Comms,
    engines: &[&mut CudaEngine],
    tensors: &[DeviceTensor<T>],
    plan: &Plan,
) -> Option<Error> {
    let ranks = comms.members.len();
    let world = comms.world;
    if engines.len() != ranks {
        return Some(Error::Usage(UsageError::RankCount {
            ranks,
            engines: engines.len(),
            tensors: tensors.len(),
        }));
    }
    if plan.steps.is_empty() {
        return Some(Error::Usage(UsageError::ZeroLength {
            what: "a collective group of no calls",
        }));
    }
    for (tensor, &rank) in tensors.iter().zip(&plan.owners) {
        let Some(&(device, id)) = comms.members.get(rank) else {
            return Some(Error::Usage(UsageError::RankCount {
                ranks,
                engines: engines.len(),
                tensors: rank + 1,
            }));
        };
        let engine = &engines[rank];
        if let Err(error) = engine
            .shared
            .check_owner(device, id)
            .and_then(|()| tensor.check_engine(engine))
        {
            return Some(error);
        }
        if tensor.is_empty() {
            return Some(Error::Usage(UsageError::ZeroLength {
                what: "a collective's tensor",
            }));
        }
    }
    let mut first_len: Vec<Option<usize>> = vec![None; plan.calls];
    for step in &plan.steps {
        let (input, output) = (tensors[step.input].len(), tensors[step.output].len());
        match step.call {
            Call::Broadcast(root) | Call::Reduce(_, root) if root >= world => {
                return Some(Error::Usage(UsageError::RootOutOfRange {
                    root,
                    ranks: world,
                }));
            }
            Call::Send(peer) | Call::Recv(peer) if peer >= world => {
                return Some(Error::Usage(UsageError::PeerOutOfRange { peer, world }));
            }
            Call::AllGather if input.checked_mul(world) != Some(output) => {
                return Some(Error::Usage(UsageError::LengthMismatch {
                    what: "all_gather: an output for the world's size times its input",
                    expected: input.saturating_mul(world),
                    found: output,
                    shape: None,
                }));
            }
            Call::ReduceScatter(_) if output.checked_mul(world) != Some(input) => {
                return Some(Error::Usage(UsageError::LengthMismatch {
                    what: "reduce_scatter: an input for the world's size times its output",
                    expected: output.saturating_mul(world),
                    found: input,
                    shape: None,
                }));
            }
            _ => {}
        }
        // The ranks here of one collective call take the same length.
        if !matches!(step.call, Call::Send(_) | Call::Recv(_)) {
            let first = *first_len[step.id].get_or_insert(input);
            if input != first {
                return Some(Error::Usage(UsageError::LengthMismatch {
                    what: match step.call {
                        Call::AllReduce(_) => {
                            "all_reduce: another rank's tensor for the first rank's"
                        }
                        Call::Broadcast(_) => {
                            "broadcast: another rank's tensor for the first rank's"
                        }
                        Call::Reduce(..) => "reduce: another rank's tensor for the first rank's",
                        _ => "collective: another rank's input for the first rank's",
                    },
                    expected: first,
                    found: input,
                    shape: None,
                }));
            }
        }
    }
    None
}

/// Queues every step into `group`, and ends it. `Err` means that any rank's part may have been
/// launched.
///
/// # Safety
/// Each tensor holds its length's elements of `T` on its rank's device and stays allocated,
/// and untouched by other work, until its part has completed on its rank's stream,
/// `streams[rank]`, the compute stream of that rank's engine; the plan's lengths were checked
/// by [`refusal`].
unsafe fn queue_group<T: Element>(
    mut group: Box<dyn SeamGroup + '_>,
    streams: &[u64],
    tensors: &[DeviceTensor<T>],
    plan: &Plan,
) -> Result<()> {
    let mut first = Ok(());
    for step in &plan.steps {
        let (input, output) = (&tensors[step.input], &tensors[step.output]);
        let count = match step.call {
            Call::AllGather | Call::Send(_) => input.len(),
            Call::ReduceScatter(_) | Call::Recv(_) => output.len(),
            Call::AllReduce(_) | Call::Broadcast(_) | Call::Reduce(..) => input.len(),
        };
        let part = seam::Part {
            stream: streams[step.rank],
            send: input.raw_ptr(),
            recv: output.raw_ptr(),
            count,
            dtype: T::DTYPE,
            kind: step.call.kind(),
        };
        // SAFETY: the caller's contract, for the step's rank.
        let queued = unsafe { group.queue(step.rank, &part) };
        if first.is_ok() {
            first = queued;
        }
    }
    // Ended whatever happened inside, as NCCL requires.
    first.and(group.end())
}

/// Validates and queues the collective. `events` are the tensors' idle events on
/// resubmission (empty otherwise); on a refusal they go back to their engines' pools.
fn submit<T: CollectiveElement>(
    comms: &Arc<Comms>,
    timeout: Duration,
    engines: &mut [&mut CudaEngine],
    tensors: Vec<DeviceTensor<T>>,
    plan: Arc<Plan>,
    events: Vec<Option<IdleEvent>>,
) -> Submitted<T> {
    if let Some(error) = refusal(comms, engines, &tensors, &plan) {
        return Err(SubmitError::Rejected {
            input: tensors,
            error,
        });
    }
    // Each rank's compute stream first waits for the earlier work on its tensors (its engine's
    // other streams); the uses are recorded, so the engine's later uses and free wait for the
    // collective.
    let mut streams = Vec::with_capacity(engines.len());
    for (rank, engine) in engines.iter_mut().enumerate() {
        let uses: Vec<Use> = tensors
            .iter()
            .zip(&plan.owners)
            .filter(|&(_, &owner)| owner == rank)
            .map(|(tensor, _)| Use::Write(tensor.raw_ptr()))
            .collect();
        let ordered = engine.shared.enter().and_then(|mut st| {
            st.order_uses(Lane::Compute, &uses)?;
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
    let group = match comms.seam.group(timeout) {
        Ok(group) => group,
        Err(error) => {
            return Err(SubmitError::Failed {
                input: tensors,
                error,
            });
        }
    };
    let submitted = Instant::now();
    // SAFETY: the buffers hold their lengths' elements of `T` on their ranks' devices (checked
    // by `refusal`), the streams are the ranks' engines' compute streams, which waited for the
    // tensors' earlier uses above, and the tensors are fenced below before anything can release
    // them (and kept, never freed, where they cannot be).
    let queued = unsafe { queue_group(group, &streams, &tensors, &plan) };
    // From here the device may touch every tensor: each is fenced on its rank's engine.
    let mut parts = Vec::with_capacity(tensors.len());
    let mut failure = queued.err();
    let mut events = events.into_iter();
    for (tensor, &rank) in tensors.into_iter().zip(&plan.owners) {
        let engine = &mut engines[rank];
        let owner = Arc::clone(&engine.shared);
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
            plan,
            timeout,
            // `Duration::MAX` (or any sum past an `Instant`'s range) is no deadline.
            deadline: crate::sync::deadline::Deadline::after_from(submitted, timeout),
        })),
        Some(error) => {
            // NCCL leaves a non-blocking communicator whose group failed in an error state for
            // good: it is aborted, which ends whatever parts were launched, and later
            // collectives on it are refused as aborted.
            if comms.seam.watched() {
                comms.seam.abort();
            }
            // Every fenced part detaches into its engine's queue as `parts` drops.
            drop(parts);
            Err(SubmitError::Retained { error })
        }
    }
}
