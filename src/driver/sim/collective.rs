//! Collectives on the simulated machine: communicators over its devices (or one rank of a
//! world that joins rank by rank, from threads of their own), and groups whose parts run as a
//! collective library's kernels meet on the device.
//!
//! A rank's collective calls in a group are one part on its stream, run together with every
//! other rank's part once each has reached the head of its stream (for joined ranks, the n-th
//! group with collective calls of each rank meets the others' n-th). Each send and receive is a
//! job of its own after it: a send runs once its receive is posted, and a receive once its send
//! has run, matched by sender, receiver and order, so a rank outside a send takes no part.
//!
//! The rank rules are NCCL's: every rank makes the same collective calls (count, element type,
//! operation, root); roots and peers are ranks; each rank's calls are on its own stream. A call
//! is checked when it is added to the group and refused there (named as NCCL's call, with
//! `ncclInvalidArgument`'s meaning) when it breaks a rule or a fault is injected for it
//! ([`SimOp::Collective`]); the group's end launches every call added, and for ranks of one
//! process refuses calls that do not fit together before launching any. Where a call was
//! refused, the others can never meet their partners: each fails when it reaches the head of
//! its stream instead of waiting for ever, touching no memory, and the next event record run on
//! that stream reports the failure (`CUDA_ERROR_LAUNCH_FAILED`), as the kernels of an aborted
//! communicator end with an error. Joined ranks' calls that do not fit together (found when
//! they meet) fail the same way on every rank; a receive whose send has another length fails
//! alone. An aborted rank's parts end alone when they reach their stream's head, touching
//! nothing, and its peers wait on, as live peers do when one rank aborts.

use super::{DevicePtr, DriverError, Job, Running, SimDevice, SimDriver, SimOp, driver_lane};
use super::{State, StreamId, Violation};
use crate::device::{DeviceId, DeviceKind};
use crate::driver::Lane;
use crate::driver::collective::{
    CollectiveKind, Collectives, Communicators, Group, Reduction, UNIQUE_ID_BYTES,
};
use crate::dtype::DType;
use crate::error::{Error, LibraryError, PeerError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// NCCL's status for a refused argument, `ncclInvalidArgument`.
const INVALID_ARGUMENT: i64 = 4;
/// NCCL's status for calls that do not fit together, `ncclInvalidUsage`.
const INVALID_USAGE: i64 = 5;

/// The numbers that name worlds of communicators, in unique ids and in the machine's state:
/// distinct across every simulated machine of the process.
static NEXT_WORLD: AtomicU64 = AtomicU64::new(1);

/// NCCL's failure of `call`: `status` (one of NCCL's), or an injected fault's code.
fn nccl(call: &'static str, status: i64, name: String) -> Error {
    Error::Library(LibraryError::Vendor {
        library: "NCCL",
        call,
        status,
        name,
    })
}

/// An injected fault of `call`, as NCCL's failure.
fn injected(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| nccl(call, i64::from(e.code()), format!("{e} (simulated)"))
}

/// One call of a rank's part: NCCL's arguments.
#[derive(Clone, Copy, Debug)]
pub(super) struct Call {
    send: DevicePtr,
    recv: DevicePtr,
    count: usize,
    dtype: DType,
    kind: CollectiveKind,
}

/// One rank's part of a collective: its calls, in order, run with every other rank's part.
#[derive(Clone, Debug)]
pub(super) struct Part {
    group: u64,
    /// The number of the communicators' world (for aborts).
    world_key: u64,
    /// The world's rank, and the world's size.
    rank: usize,
    ranks: usize,
    calls: Vec<Call>,
    /// Whether every rank's part was launched: a part without all its partners fails instead.
    complete: bool,
    /// Whether its world's ranks joined one by one (the other parts may come from threads yet
    /// to queue them).
    pub(super) joined: bool,
}

/// Which send meets which receive: the world's number, the sending and receiving ranks, and
/// the send's order among those from one to the other.
pub(super) type Channel = (u64, usize, usize, u64);

/// A send or a receive, queued on its rank's stream after the rank's collective part.
#[derive(Clone, Debug)]
pub(super) struct P2p {
    channel: Channel,
    /// This rank (the world's).
    rank: usize,
    ptr: DevicePtr,
    bytes: usize,
    send: bool,
    complete: bool,
    pub(super) joined: bool,
}

/// The communicators of one set of ranks on the simulated machine.
struct SimComms {
    device: SimDevice,
    /// The ranks these communicators hold: all of the world's (`ncclCommInitAll`), or one.
    ranks: usize,
    /// The number of their world.
    key: u64,
    /// For one rank of a world that joined one by one: which, and its collectives so far.
    joined: Option<Joined>,
    /// Whether they were aborted.
    aborted: AtomicBool,
}

/// One rank of a world of joined ranks (`ncclCommInitRank`).
struct Joined {
    rank: usize,
    world: usize,
    /// How many groups this rank has ended: the next one's sequence number.
    next: AtomicU64,
}

/// A collective of joined ranks, as the ranks' group ends reach it: its number, and how many
/// ranks have queued their part.
pub(super) struct JoinedGroup {
    group: u64,
    queued: usize,
}

/// An open group on the simulated machine: the calls added so far, by rank (with its stream),
/// launched by its end (or its drop).
struct SimGroup<'a> {
    comms: &'a SimComms,
    parts: Vec<(StreamId, usize, Vec<Call>)>,
    /// Whether a call was refused: then every call launched fails alone.
    refused: bool,
    /// Until `end` closes it (else the drop does).
    open: bool,
}

impl SimComms {
    fn aborted_error(&self) -> Error {
        let (rank, world) = self.world();
        PeerError::Aborted { rank, world }.into()
    }

    /// This world rank of the first rank held here, and the world's size.
    fn world(&self) -> (usize, usize) {
        self.joined
            .as_ref()
            .map_or((0, self.ranks), |j| (j.rank, j.world))
    }
}

impl Collectives for SimDriver {
    /// The simulator's ids: a mark, the machine's instance and the world's number, so that ids
    /// of one machine are distinct and those of another machine are told apart.
    fn unique_id(&self) -> Result<(u32, [u8; UNIQUE_ID_BYTES]), Error> {
        let mut s = self.lock();
        s.enter(SimOp::UniqueId)
            .map_err(injected("ncclGetUniqueId"))?;
        let mut id = [0u8; UNIQUE_ID_BYTES];
        id[..8].copy_from_slice(b"SIM-NCCL");
        id[8..16].copy_from_slice(&s.instance.to_le_bytes());
        id[16..24].copy_from_slice(&NEXT_WORLD.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        Ok((0, id))
    }

    fn communicators(&self, devices: &[DeviceId]) -> Result<Box<dyn Communicators>, Error> {
        let mut s = self.lock();
        s.enter(SimOp::CommInit)
            .map_err(injected("ncclCommInitAll"))?;
        let ours = |d: &DeviceId| {
            d.kind == DeviceKind::Simulated
                && d.instance == s.instance
                && d.ordinal >= s.ordinal
                && d.ordinal - s.ordinal < s.ctxs.len()
        };
        if devices.is_empty() || !devices.iter().all(ours) {
            return Err(nccl(
                "ncclCommInitAll",
                INVALID_ARGUMENT,
                "ncclInvalidArgument: a device of another machine".into(),
            ));
        }
        Ok(Box::new(SimComms {
            device: self.device.clone(),
            ranks: devices.len(),
            key: NEXT_WORLD.fetch_add(1, Ordering::Relaxed),
            joined: None,
            aborted: AtomicBool::new(false),
        }))
    }

    /// Joins the world the id names on this machine: every rank registers, then waits (the
    /// machine's lock released) until the world is whole, as `ncclCommInitRank` does.
    fn join(
        &self,
        id: &[u8; UNIQUE_ID_BYTES],
        library: u32,
        rank: usize,
        world: usize,
        timeout: std::time::Duration,
    ) -> Result<Box<dyn Communicators>, Error> {
        const CALL: &str = "ncclCommInitRank";
        if library != 0 {
            return Err(crate::driver::collective::other_library(library, 0));
        }
        let invalid = |why: String| {
            nccl(
                CALL,
                INVALID_ARGUMENT,
                format!("ncclInvalidArgument: {why}"),
            )
        };
        let key = {
            let mut s = self.lock();
            s.enter(SimOp::CommInit).map_err(injected(CALL))?;
            let instance = u64::from_le_bytes(id[8..16].try_into().expect("eight bytes"));
            if &id[..8] != b"SIM-NCCL" || instance != s.instance {
                return Err(invalid("an id of another machine".into()));
            }
            if world == 0 || rank >= world {
                return Err(invalid(format!("rank {rank} of a world of {world}")));
            }
            let key = u64::from_le_bytes(id[16..24].try_into().expect("eight bytes"));
            let (size, joined) = s.joins.entry(key).or_insert_with(|| (world, Vec::new()));
            if *size != world {
                return Err(invalid(format!(
                    "a world of {world}, where the first rank joined one of {size}"
                )));
            }
            if joined.contains(&rank) {
                return Err(nccl(
                    CALL,
                    INVALID_USAGE,
                    format!("ncclInvalidUsage: rank {rank} joined twice"),
                ));
            }
            joined.push(rank);
            key
        };
        let start = std::time::Instant::now();
        loop {
            {
                let mut s = self.lock();
                let whole = s.joins.get(&key).is_some_and(|(_, j)| j.len() == world);
                if whole {
                    break;
                }
                if start.elapsed() > timeout {
                    // Aborted: this rank leaves the world it began to join, and says which
                    // ranks had not come.
                    let mut missing = Vec::new();
                    if let Some((_, joined)) = s.joins.get_mut(&key) {
                        missing = (0..world).filter(|r| !joined.contains(r)).collect();
                        joined.retain(|&r| r != rank);
                    }
                    return Err(crate::error::PeerError::Unjoined {
                        rank,
                        world,
                        waited: start.elapsed(),
                        missing: Some(missing),
                    }
                    .into());
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(Box::new(SimComms {
            device: self.device.clone(),
            ranks: 1,
            key,
            joined: Some(Joined {
                rank,
                world,
                next: AtomicU64::new(0),
            }),
            aborted: AtomicBool::new(false),
        }))
    }
}

impl Communicators for SimComms {
    /// The simulated end queues every part at once: it never waits, so `timeout` is unused.
    fn group(&self, _timeout: std::time::Duration) -> Result<Box<dyn Group + '_>, Error> {
        let mut s = self.device.lock();
        s.enter(SimOp::GroupStart)
            .map_err(injected("ncclGroupStart"))?;
        if self.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        Ok(Box::new(SimGroup {
            comms: self,
            parts: Vec::new(),
            refused: false,
            open: true,
        }))
    }

    fn watched(&self) -> bool {
        self.joined.is_some()
    }

    fn health(&self) -> Result<(), Error> {
        self.device
            .lock()
            .enter(SimOp::CommHealth)
            .map_err(injected("ncclCommGetAsyncError"))?;
        if self.aborted.load(Ordering::Acquire) {
            return Err(self.aborted_error());
        }
        Ok(())
    }

    /// Marks this set's ranks aborted: each of their parts then ends alone when it reaches its
    /// stream's head (at once, for one waiting there), touching nothing, and its partners wait
    /// on for parts that never come, as a live peer's kernels do when one rank aborts.
    fn abort(&self) {
        if self.aborted.swap(true, Ordering::AcqRel) {
            return;
        }
        let (first, _) = self.world();
        let mut s = self.device.lock();
        for rank in first..first + self.ranks {
            s.aborted_ranks.insert((self.key, rank));
        }
        drop(s);
        self.device.inner.progress.notify_all();
    }
}

impl Group for SimGroup<'_> {
    unsafe fn queue(
        &mut self,
        rank: usize,
        part: &crate::driver::collective::Part,
    ) -> Result<(), Error> {
        let queued = self.add(rank, part);
        self.refused |= queued.is_err();
        queued
    }

    fn end(mut self: Box<Self>) -> Result<(), Error> {
        self.close()
    }
}

impl SimGroup<'_> {
    /// Checks a call and adds it to its rank's part.
    fn add(&mut self, rank: usize, part: &crate::driver::collective::Part) -> Result<(), Error> {
        let call = part.kind.call();
        let invalid = |why: &str| {
            nccl(
                call,
                INVALID_ARGUMENT,
                format!("ncclInvalidArgument: {why}"),
            )
        };
        let ranks = self.comms.ranks;
        let (_, world) = self.comms.world();
        let parts = &mut self.parts;
        let mut s = self.comms.device.lock();
        s.enter(SimOp::Collective).map_err(injected(call))?;
        if rank >= ranks {
            return Err(invalid("no such rank"));
        }
        if matches!(part.dtype, DType::I16 | DType::U16 | DType::Bool) {
            return Err(invalid("an element type NCCL does not reduce"));
        }
        match part.kind {
            CollectiveKind::Broadcast { root } | CollectiveKind::Reduce { root, .. }
                if root >= world =>
            {
                return Err(invalid("the root is not a rank"));
            }
            CollectiveKind::Send { peer } | CollectiveKind::Recv { peer } if peer >= world => {
                return Err(invalid("the peer is not a rank"));
            }
            _ => {}
        }
        let stream = s
            .compute_stream_of(part.stream)
            .ok_or_else(|| invalid("not a compute stream of this machine"))?;
        let (read, written) = part.kind.extents(part.count, world);
        for (ptr, elems) in [(part.send, read), (part.recv, written)] {
            if elems == 0 {
                continue;
            }
            let bytes = elems
                .checked_mul(part.dtype.size_bytes())
                .ok_or_else(|| invalid("the count overflows"))?;
            if s.block_mut(ptr, bytes).is_none() {
                return Err(invalid("a buffer lies outside every allocation"));
            }
        }
        if parts
            .iter()
            .any(|&(other, r, _)| (other == stream) != (r == rank))
        {
            return Err(invalid("two ranks on one stream, or one rank on two"));
        }
        s.refuse_in_capture(stream).map_err(injected(call))?;
        let call = Call {
            send: part.send,
            recv: part.recv,
            count: part.count,
            dtype: part.dtype,
            kind: part.kind,
        };
        match parts.iter_mut().find(|(_, r, _)| *r == rank) {
            Some((_, _, calls)) => calls.push(call),
            None => parts.push((stream, rank, vec![call])),
        }
        Ok(())
    }

    /// Closes the group: launches every rank's part, or none when the end is refused. A
    /// rank's collective calls become one part, run with every rank's; each of its sends and
    /// receives a job of its own, after it, which meets its peer's.
    fn close(&mut self) -> Result<(), Error> {
        const CALL: &str = "ncclGroupEnd";
        self.open = false;
        let parts = std::mem::take(&mut self.parts);
        let mut s = self.comms.device.lock();
        s.enter(SimOp::GroupEnd).map_err(injected(CALL))?;
        if parts.is_empty() {
            return Ok(());
        }
        let (first, world) = self.comms.world();
        let key = self.comms.key;
        let joined = self.comms.joined.as_ref();
        let complete = !self.refused;
        let has_collectives = parts
            .iter()
            .any(|(_, _, calls)| calls.iter().any(|c| !c.kind.is_p2p()));
        // Every rank of a communicator in this process is here: calls that do not fit
        // together are refused now, before any is launched.
        if joined.is_none() && complete {
            let calls: Vec<(usize, &[Call])> = parts
                .iter()
                .map(|(_, rank, calls)| (*rank, calls.as_slice()))
                .collect();
            // A rank without calls has no collective calls either.
            if has_collectives && calls.len() != self.comms.ranks {
                return Err(nccl(
                    CALL,
                    INVALID_USAGE,
                    "ncclInvalidUsage: a rank has no part in the group's collective".into(),
                ));
            }
            if let Some(why) = collectives_differ(&calls).or_else(|| p2p_unmatched(&calls)) {
                return Err(nccl(
                    CALL,
                    INVALID_USAGE,
                    format!("ncclInvalidUsage: {why}"),
                ));
            }
        }
        // The collective's number: a fresh one here, or, for joined ranks, which end their
        // groups in their own time, that of the n-th group with collective calls of every rank.
        let mut whole = false;
        let group = match joined.filter(|_| has_collectives) {
            None => {
                s.next_group += 1;
                s.next_group - 1
            }
            Some(joined) => {
                let seq = joined.next.fetch_add(1, Ordering::Relaxed);
                let next = s.next_group;
                let entry = s.joined_groups.entry((key, seq)).or_insert(JoinedGroup {
                    group: next,
                    queued: 0,
                });
                entry.queued += 1;
                let group = entry.group;
                if entry.queued == joined.world {
                    s.joined_groups.remove(&(key, seq));
                    whole = true;
                }
                if group == next {
                    s.next_group += 1;
                }
                group
            }
        };
        let mut runnable = Vec::new();
        for (stream, rank, calls) in parts {
            let rank = first + rank;
            let (collective, p2p): (Vec<Call>, Vec<Call>) =
                calls.into_iter().partition(|c| !c.kind.is_p2p());
            if !collective.is_empty() {
                let part = Part {
                    group,
                    world_key: key,
                    rank,
                    ranks: world,
                    calls: collective,
                    complete,
                    joined: joined.is_some(),
                };
                let seq = s.push(stream, Job::Collective(part));
                if whole {
                    runnable.push(seq);
                }
            }
            // Sends first: a ring's receives then find their sends posted.
            let (sends, recvs): (Vec<Call>, Vec<Call>) = p2p
                .into_iter()
                .partition(|c| matches!(c.kind, CollectiveKind::Send { .. }));
            for c in sends.into_iter().chain(recvs) {
                let (from, to, send) = match c.kind {
                    CollectiveKind::Send { peer } => (rank, peer, true),
                    CollectiveKind::Recv { peer } => (peer, rank, false),
                    _ => unreachable!("partitioned above"),
                };
                let counter = s.p2p_next.entry((key, from, to, send)).or_insert(0);
                let nth = *counter;
                *counter += 1;
                let job = P2p {
                    channel: (key, from, to, nth),
                    rank,
                    ptr: if send { c.send } else { c.recv },
                    bytes: c.count * c.dtype.size_bytes(),
                    send,
                    complete,
                    joined: joined.is_some(),
                };
                let seq = s.push(stream, Job::P2p(job));
                if send {
                    s.p2p_sends.insert((key, from, to, nth), seq);
                } else {
                    s.p2p_posted.insert((key, from, to, nth), seq);
                }
                if joined.is_some() {
                    runnable.push(seq);
                }
            }
        }
        // Joined ranks' parts meet as the last of them arrives: the device runs what it can
        // now, as every rank's kernels do (the ranks' awaits are woken by it), unless only
        // `advance` runs the device.
        if !s.clock_held {
            for seq in runnable {
                s.run_through(seq);
            }
        }
        drop(s);
        // Ranks on other threads may be waiting for these parts.
        self.comms.device.inner.progress.notify_all();
        Ok(())
    }
}

impl Drop for SimGroup<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = self.close();
        }
    }
}

/// Why the ranks' collective calls (each rank's, in order) do not fit together, if they do
/// not: every rank makes the same collective calls in the same order (kind, count, element
/// type).
fn collectives_differ(parts: &[(usize, &[Call])]) -> Option<&'static str> {
    let collectives = |calls: &[Call]| -> Vec<(CollectiveKind, usize, DType)> {
        calls
            .iter()
            .filter(|c| !c.kind.is_p2p())
            .map(|c| (c.kind, c.count, c.dtype))
            .collect()
    };
    let first = collectives(parts.first()?.1);
    parts
        .iter()
        .any(|(_, calls)| collectives(calls) != first)
        .then_some("the ranks' collective calls differ")
}

/// Why the ranks' sends and receives (each rank's, by world rank) do not pair up, if they do
/// not: each rank's sends to a peer match that peer's receives from it, in order, in count and
/// element type.
fn p2p_unmatched(parts: &[(usize, &[Call])]) -> Option<&'static str> {
    let mut sends: HashMap<(usize, usize), Vec<(usize, DType)>> = HashMap::new();
    let mut recvs: HashMap<(usize, usize), Vec<(usize, DType)>> = HashMap::new();
    for &(rank, calls) in parts {
        for c in calls {
            match c.kind {
                CollectiveKind::Send { peer } => {
                    sends
                        .entry((rank, peer))
                        .or_default()
                        .push((c.count, c.dtype));
                }
                CollectiveKind::Recv { peer } => {
                    recvs
                        .entry((peer, rank))
                        .or_default()
                        .push((c.count, c.dtype));
                }
                _ => {}
            }
        }
    }
    (sends != recvs)
        .then_some("a send and its receive differ in count or element type, or one has no match")
}

impl State {
    /// The compute stream a raw stream handle names (see `SimDriver::stream_handle`: this
    /// machine's tag in the low bits, the driver's first stream above them), if it is one of this
    /// machine's.
    pub(super) fn compute_stream_of(&self, handle: u64) -> Option<StreamId> {
        let base = usize::try_from(handle >> 32).ok()?;
        if handle & 0xffff_ffff != (self.instance << 8 | 1) || base >= self.next_stream {
            return None;
        }
        Some(base + Lane::Compute.index())
    }

    /// Whether `part`'s rank was aborted.
    fn aborted(&self, part: &Part) -> bool {
        self.aborted_ranks.contains(&(part.world_key, part.rank))
    }

    /// What the part at a stream's head waits for: nothing once every part of its collective is
    /// at the head of its stream (or it was aborted, or launched without its partners: it then
    /// ends alone), else the first part that is not (or a number never given out, should a
    /// part be missing: then nothing can run it).
    pub(super) fn collective_blocked_on(&self, part: &Part) -> Option<u64> {
        if !part.complete || self.aborted(part) {
            return None;
        }
        let ours = |job: &Job| matches!(job, Job::Collective(p) if p.group == part.group && !self.aborted(p));
        let at_head = self
            .streams
            .values()
            .filter(|queue| queue.front().is_some_and(|(_, job)| ours(job)))
            .count();
        if at_head == part.ranks {
            return None;
        }
        let behind = self
            .streams
            .values()
            .flat_map(|queue| queue.iter().skip(1))
            .find(|(_, job)| ours(job))
            .map(|&(seq, _)| seq);
        Some(behind.unwrap_or(u64::MAX))
    }

    /// Runs a collective: `part` (job `seq`, already taken from `stream`) and the other ranks'
    /// parts, taken from the heads of their streams here.
    pub(super) fn run_collective(&mut self, seq: u64, stream: StreamId, part: Part) {
        if self.aborted(&part) {
            return; // its communicator's abort ended it: nothing touched
        }
        if !part.complete {
            self.failed_streams
                .insert(stream, DriverError::LAUNCH_FAILED);
            return;
        }
        let group = part.group;
        let mut parts = vec![(seq, stream, part)];
        let heads: Vec<StreamId> = self
            .streams
            .iter()
            .filter(|(_, queue)| {
                matches!(queue.front(), Some((_, Job::Collective(p))) if p.group == group)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in heads {
            let queue = self.streams.get_mut(&id).expect("a stream with a head");
            let Some((other, Job::Collective(p))) = queue.pop_front() else {
                unreachable!("the head was just seen to be a part");
            };
            if queue.is_empty() {
                self.streams.remove(&id);
            }
            self.pending.remove(&other);
            parts.push((other, id, p));
        }
        parts.sort_by_key(|(_, _, p)| p.rank);
        // The other parts complete with this one (the caller counts this one).
        for &(other, _, _) in &parts {
            if other == seq {
                continue;
            }
            self.completed_jobs += 1;
            if let Some(wakes) = self.wakes.remove(&other) {
                self.woken.extend(wakes);
            }
        }
        let calls: Vec<(usize, &[Call])> = parts
            .iter()
            .map(|(_, _, p)| (p.rank, p.calls.as_slice()))
            .collect();
        if collectives_differ(&calls).is_some() {
            // Calls that do not meet: every rank's kernels end with an error, touching nothing.
            for &(_, stream, _) in &parts {
                self.failed_streams
                    .insert(stream, DriverError::LAUNCH_FAILED);
            }
            return;
        }
        self.meet(&parts);
    }

    /// Runs the calls of every rank's part (one per rank, in rank order): reads every input,
    /// then writes every output.
    fn meet(&mut self, parts: &[(u64, StreamId, Part)]) {
        let world = parts.len();
        let mut inputs: Vec<Vec<Vec<u8>>> = Vec::with_capacity(world);
        for &(seq, stream, ref p) in parts {
            self.running = Some(Running {
                seq,
                kind: "collective",
                stream,
            });
            let mut mine = Vec::with_capacity(p.calls.len());
            for c in &p.calls {
                let (read, _) = c.kind.extents(c.count, world);
                let bytes = read * c.dtype.size_bytes();
                if bytes == 0 {
                    mine.push(Vec::new());
                    continue;
                }
                self.access(c.send, false);
                match self.block_mut(c.send, bytes) {
                    Some(block) => mine.push(block.to_vec()),
                    None => {
                        let (driver, lane) = driver_lane(stream);
                        self.violations.push(Violation::UnmappedCollective {
                            driver,
                            lane,
                            ptr: c.send,
                            bytes,
                        });
                        return;
                    }
                }
            }
            inputs.push(mine);
        }
        // (rank, address, bytes) of each output.
        let mut outputs: Vec<(usize, DevicePtr, Vec<u8>)> = Vec::new();
        let collective_calls: Vec<Vec<usize>> = parts
            .iter()
            .map(|(_, _, p)| {
                (0..p.calls.len())
                    .filter(|&i| !p.calls[i].kind.is_p2p())
                    .collect()
            })
            .collect();
        // The k-th collective call of every rank meets the others' k-th.
        #[allow(clippy::needless_range_loop)]
        for k in 0..collective_calls[0].len() {
            let at = |r: usize| collective_calls[r][k];
            let ins: Vec<Vec<u8>> = (0..world).map(|r| inputs[r][at(r)].clone()).collect();
            let recv = |r: usize| parts[r].2.calls[at(r)].recv;
            let c = parts[0].2.calls[at(0)];
            match c.kind {
                CollectiveKind::AllReduce(op) => {
                    let out = reduce(c.dtype, op, &ins);
                    outputs.extend((0..world).map(|r| (r, recv(r), out.clone())));
                }
                CollectiveKind::Broadcast { root } => {
                    outputs.extend((0..world).map(|r| (r, recv(r), ins[root].clone())));
                }
                CollectiveKind::Reduce { op, root } => {
                    outputs.push((root, recv(root), reduce(c.dtype, op, &ins)));
                }
                CollectiveKind::AllGather => {
                    let out = ins.concat();
                    outputs.extend((0..world).map(|r| (r, recv(r), out.clone())));
                }
                CollectiveKind::ReduceScatter(op) => {
                    let full = reduce(c.dtype, op, &ins);
                    let chunk = c.count * c.dtype.size_bytes();
                    outputs.extend(
                        (0..world).map(|r| (r, recv(r), full[r * chunk..(r + 1) * chunk].to_vec())),
                    );
                }
                CollectiveKind::Send { .. } | CollectiveKind::Recv { .. } => {
                    unreachable!("point-to-point calls are jobs of their own")
                }
            }
        }
        for (r, ptr, bytes) in outputs {
            let (seq, stream, _) = parts[r];
            self.running = Some(Running {
                seq,
                kind: "collective",
                stream,
            });
            self.access(ptr, true);
            match self.block_mut(ptr, bytes.len()) {
                Some(block) => block.copy_from_slice(&bytes),
                None => {
                    let (driver, lane) = driver_lane(stream);
                    self.violations.push(Violation::UnmappedCollective {
                        driver,
                        lane,
                        ptr,
                        bytes: bytes.len(),
                    });
                }
            }
        }
    }
}

impl State {
    /// What a send or a receive at its stream's head waits for: a send, for its receive to be
    /// posted; a receive, for its send to have run (that send's job, where it is queued, else
    /// a number never given out). Nothing for one aborted or launched without its partners:
    /// it ends alone.
    pub(super) fn p2p_blocked_on(&self, p: &P2p) -> Option<u64> {
        if !p.complete || self.aborted_ranks.contains(&(p.channel.0, p.rank)) {
            return None;
        }
        if p.send {
            return (!self.p2p_posted.contains_key(&p.channel)).then_some(u64::MAX);
        }
        if self.p2p_data.contains_key(&p.channel) {
            return None;
        }
        // Its send's job while it is queued; a number never given out once it ended without
        // sending (aborted) or was never queued: then nothing can run this receive.
        Some(
            self.p2p_sends
                .get(&p.channel)
                .copied()
                .filter(|&seq| !self.is_done(seq))
                .unwrap_or(u64::MAX),
        )
    }

    /// Runs a send (its bytes taken for its receive) or a receive (its send's bytes written).
    pub(super) fn run_p2p(&mut self, stream: StreamId, p: P2p) {
        // Run or ended, it is no longer queued: its peer stops waiting for it here.
        if p.send {
            self.p2p_sends.remove(&p.channel);
        } else {
            self.p2p_posted.remove(&p.channel);
        }
        if self.aborted_ranks.contains(&(p.channel.0, p.rank)) {
            return; // its communicator's abort ended it: nothing touched
        }
        if !p.complete {
            self.failed_streams
                .insert(stream, DriverError::LAUNCH_FAILED);
            return;
        }
        let (driver, lane) = driver_lane(stream);
        if p.send {
            self.access(p.ptr, false);
            match self.block_mut(p.ptr, p.bytes) {
                Some(block) => {
                    let data = block.to_vec();
                    self.p2p_data.insert(p.channel, data);
                }
                None => self.violations.push(Violation::UnmappedCollective {
                    driver,
                    lane,
                    ptr: p.ptr,
                    bytes: p.bytes,
                }),
            }
            return;
        }
        let data = self.p2p_data.remove(&p.channel).unwrap_or_default();
        if data.len() != p.bytes {
            // A send of another length: the receive's kernel ends with an error, touching
            // nothing.
            self.failed_streams
                .insert(stream, DriverError::LAUNCH_FAILED);
            return;
        }
        self.access(p.ptr, true);
        match self.block_mut(p.ptr, p.bytes) {
            Some(block) => block.copy_from_slice(&data),
            None => self.violations.push(Violation::UnmappedCollective {
                driver,
                lane,
                ptr: p.ptr,
                bytes: p.bytes,
            }),
        }
    }

    /// Whether a job of a world of joined ranks is queued: a wait may then be waiting for a
    /// part that a rank on another thread has yet to queue.
    pub(super) fn awaits_peers(&self) -> bool {
        self.streams.values().flatten().any(|(_, job)| match job {
            Job::Collective(p) => p.joined,
            Job::P2p(p) => p.joined,
            _ => false,
        })
    }
}

/// The element-wise reduction of `inputs` (one buffer per rank, in rank order) by `op`: in rank
/// order, rounded to the element type at each step, integers wrapping. The mean divides the
/// reduced sum by the rank count, whatever it is (integers truncated toward zero).
fn reduce(dtype: DType, op: Reduction, inputs: &[Vec<u8>]) -> Vec<u8> {
    let n = inputs.len();
    macro_rules! fold {
        ($t:ty, $size:expr_2021, $from:expr_2021, $to:expr_2021, $add:expr_2021, $mul:expr_2021, $div:expr_2021) => {{
            let read = |buf: &[u8], i: usize| -> $t {
                let mut b = [0u8; $size];
                b.copy_from_slice(&buf[i * $size..(i + 1) * $size]);
                $from(b)
            };
            let elems = inputs[0].len() / $size;
            let mut out = Vec::with_capacity(inputs[0].len());
            for i in 0..elems {
                let mut acc: $t = read(&inputs[0], i);
                for buf in &inputs[1..] {
                    let x = read(buf, i);
                    acc = match op {
                        Reduction::Sum | Reduction::Avg => $add(acc, x),
                        Reduction::Prod => $mul(acc, x),
                        Reduction::Max => {
                            if x > acc {
                                x
                            } else {
                                acc
                            }
                        }
                        Reduction::Min => {
                            if x < acc {
                                x
                            } else {
                                acc
                            }
                        }
                    };
                }
                if op == Reduction::Avg {
                    acc = $div(acc, n);
                }
                out.extend_from_slice(&$to(acc));
            }
            out
        }};
    }
    macro_rules! int {
        ($t:ty, $size:expr_2021) => {
            fold!(
                $t,
                $size,
                <$t>::from_le_bytes,
                <$t>::to_le_bytes,
                <$t>::wrapping_add,
                <$t>::wrapping_mul,
                // In a type that holds every element and every rank count: `n` as `$t` wraps
                // (256 ranks are 0 as `u8`, 255 are -1 as `i8`), and NCCL takes any count.
                |a: $t, n: usize| {
                    let q = i128::from(a) / i128::try_from(n).expect("a rank count fits in i128");
                    <$t>::try_from(q).expect("a quotient is no larger than its dividend")
                }
            )
        };
    }
    macro_rules! float {
        ($t:ty, $size:expr_2021) => {
            fold!(
                $t,
                $size,
                <$t>::from_le_bytes,
                <$t>::to_le_bytes,
                |a: $t, b: $t| a + b,
                |a: $t, b: $t| a * b,
                |a: $t, n: usize| a / (n as $t)
            )
        };
    }
    macro_rules! half {
        ($t:ty) => {
            fold!(
                $t,
                2,
                <$t>::from_le_bytes,
                <$t>::to_le_bytes,
                |a: $t, b: $t| <$t>::from_f32(a.to_f32() + b.to_f32()),
                |a: $t, b: $t| <$t>::from_f32(a.to_f32() * b.to_f32()),
                |a: $t, n: usize| <$t>::from_f32(a.to_f32() / n as f32)
            )
        };
    }
    match dtype {
        DType::I8 => int!(i8, 1),
        DType::U8 => int!(u8, 1),
        DType::I32 => int!(i32, 4),
        DType::U32 => int!(u32, 4),
        DType::I64 => int!(i64, 8),
        DType::U64 => int!(u64, 8),
        DType::F32 => float!(f32, 4),
        DType::F64 => float!(f64, 8),
        DType::F16 => half!(half::f16),
        DType::BF16 => half!(half::bf16),
        // Refused when queued.
        DType::I16 | DType::U16 | DType::Bool => unreachable!("no collective of {dtype:?}"),
    }
}
