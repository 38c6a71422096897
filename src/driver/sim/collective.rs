//! Collectives on the simulated machine: communicators over its devices, and groups whose parts,
//! one per rank on that rank's stream, run together once each has reached the head of its
//! stream, as a collective library's kernels meet on the device.
//!
//! The rank rules are NCCL's: every part of a group names the same count, element type and
//! operation; a broadcast's root is a rank; each rank's part is on its own stream. A part is
//! checked when it is added to the group and refused there (named as NCCL's call, with
//! `ncclInvalidArgument`'s meaning) when it breaks a rule or a fault is injected for it
//! ([`SimOp::Collective`]); the group's end launches every part added, refused ones aside. A
//! part launched without all its partners can never meet them: when it reaches the head of its
//! stream it fails there instead of waiting for ever, touching no memory, and the next event
//! record run on that stream reports the failure (`CUDA_ERROR_LAUNCH_FAILED`), as the kernels of
//! an aborted communicator end with an error.

use super::{DevicePtr, DriverError, Job, Running, SimDevice, SimDriver, SimOp, driver_lane};
use super::{State, StreamId, Violation};
use crate::driver::Lane;
use crate::driver::collective::{
    CollectiveKind, Collectives, Communicators, Group, Reduction, UNIQUE_ID_BYTES,
};
use crate::dtype::DType;
use crate::error::{DeviceId, DeviceKind, Error, LibraryError};
use std::sync::atomic::{AtomicU64, Ordering};

/// NCCL's status for a refused argument, `ncclInvalidArgument`.
const INVALID_ARGUMENT: i64 = 4;
/// NCCL's status for calls that do not fit together, `ncclInvalidUsage`.
const INVALID_USAGE: i64 = 5;

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

/// One rank's part of a collective.
#[derive(Clone, Copy, Debug)]
pub(super) struct Part {
    group: u64,
    rank: usize,
    ranks: usize,
    ptr: DevicePtr,
    count: usize,
    dtype: DType,
    kind: CollectiveKind,
    /// Whether every rank's part was launched: a part without all its partners fails instead.
    complete: bool,
}

/// The communicators of one set of ranks on the simulated machine.
struct SimComms {
    device: SimDevice,
    /// The ranks these communicators hold: all of the world's (`ncclCommInitAll`), or one.
    ranks: usize,
    /// For one rank of a world that joined one by one: which, and its collectives so far.
    joined: Option<Joined>,
}

/// One rank of a world of joined ranks (`ncclCommInitRank`).
struct Joined {
    /// The id's number, which names the world on the machine.
    key: u64,
    rank: usize,
    world: usize,
    /// How many groups this rank has ended: the next one's sequence number.
    next: AtomicU64,
}

/// A collective of joined ranks, as the ranks' group ends reach it: its number, how many
/// ranks have queued their part, and the first part's count, element type and kind.
pub(super) struct JoinedGroup {
    group: u64,
    queued: usize,
    shape: (usize, DType, CollectiveKind),
}

/// An open group on the simulated machine: the parts added so far, each with its stream,
/// launched by its end (or its drop).
struct SimGroup<'a> {
    comms: &'a SimComms,
    parts: Vec<(StreamId, Part)>,
    /// Until `end` closes it (else the drop does).
    open: bool,
}

impl Collectives for SimDriver {
    /// The simulator's ids: a mark, the machine's instance and a count, so that ids of one
    /// machine are distinct and those of another machine are told apart.
    fn unique_id(&self) -> Result<(u32, [u8; UNIQUE_ID_BYTES]), Error> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let mut s = self.lock();
        s.enter(SimOp::UniqueId)
            .map_err(injected("ncclGetUniqueId"))?;
        let mut id = [0u8; UNIQUE_ID_BYTES];
        id[..8].copy_from_slice(b"SIM-NCCL");
        id[8..16].copy_from_slice(&s.instance.to_le_bytes());
        id[16..24].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
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
            joined: None,
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
                    // Aborted: this rank leaves the world it began to join.
                    if let Some((_, joined)) = s.joins.get_mut(&key) {
                        joined.retain(|&r| r != rank);
                    }
                    return Err(crate::error::BootstrapError::Unjoined {
                        rank,
                        world,
                        waited: start.elapsed(),
                    }
                    .into());
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(Box::new(SimComms {
            device: self.device.clone(),
            ranks: 1,
            joined: Some(Joined {
                key,
                rank,
                world,
                next: AtomicU64::new(0),
            }),
        }))
    }
}

impl Communicators for SimComms {
    fn group(&self) -> Result<Box<dyn Group + '_>, Error> {
        self.device
            .lock()
            .enter(SimOp::GroupStart)
            .map_err(injected("ncclGroupStart"))?;
        Ok(Box::new(SimGroup {
            comms: self,
            parts: Vec::new(),
            open: true,
        }))
    }
}

impl Group for SimGroup<'_> {
    unsafe fn queue(
        &mut self,
        rank: usize,
        part: &crate::driver::collective::Part,
    ) -> Result<(), Error> {
        let call = match part.kind {
            CollectiveKind::AllReduce(_) => "ncclAllReduce",
            CollectiveKind::Broadcast { .. } => "ncclBroadcast",
        };
        let invalid = |why: &str| {
            nccl(
                call,
                INVALID_ARGUMENT,
                format!("ncclInvalidArgument: {why}"),
            )
        };
        let ranks = self.comms.ranks;
        let parts = &mut self.parts;
        let mut s = self.comms.device.lock();
        s.enter(SimOp::Collective).map_err(injected(call))?;
        if rank >= ranks || parts.iter().any(|(_, p)| p.rank == rank) {
            return Err(invalid("no such rank, or its part is already in the group"));
        }
        if matches!(part.dtype, DType::I16 | DType::U16 | DType::Bool) {
            return Err(invalid("an element type NCCL does not reduce"));
        }
        let (global, world) = self
            .comms
            .joined
            .as_ref()
            .map_or((rank, ranks), |j| (j.rank, j.world));
        if let CollectiveKind::Broadcast { root } = part.kind
            && root >= world
        {
            return Err(invalid("the root is not a rank"));
        }
        let stream = s
            .compute_stream_of(part.stream)
            .ok_or_else(|| invalid("not a compute stream of this machine"))?;
        let bytes = part
            .count
            .checked_mul(part.dtype.size_bytes())
            .ok_or_else(|| invalid("the count overflows"))?;
        if s.block_mut(part.buffer, bytes).is_none() {
            return Err(invalid("the buffer lies outside every allocation"));
        }
        if parts.iter().any(|&(other, _)| other == stream) {
            return Err(invalid("two ranks on one stream"));
        }
        s.refuse_in_capture(stream).map_err(injected(call))?;
        parts.push((
            stream,
            Part {
                group: 0,
                rank: global,
                ranks: world,
                ptr: part.buffer,
                count: part.count,
                dtype: part.dtype,
                kind: part.kind,
                complete: false,
            },
        ));
        Ok(())
    }

    fn end(mut self: Box<Self>) -> Result<(), Error> {
        self.close()
    }
}

impl SimGroup<'_> {
    /// Closes the group: launches every part added, or none when the end is refused.
    fn close(&mut self) -> Result<(), Error> {
        const CALL: &str = "ncclGroupEnd";
        self.open = false;
        let parts = std::mem::take(&mut self.parts);
        let mut s = self.comms.device.lock();
        s.enter(SimOp::GroupEnd).map_err(injected(CALL))?;
        let Some(&(_, first)) = parts.first() else {
            return Ok(());
        };
        if parts
            .iter()
            .any(|(_, p)| (p.count, p.dtype, p.kind) != (first.count, first.dtype, first.kind))
        {
            return Err(nccl(
                CALL,
                INVALID_USAGE,
                "ncclInvalidUsage: the ranks' calls differ".into(),
            ));
        }
        let (group_id, complete) = match &self.comms.joined {
            None => {
                let group = s.next_group;
                s.next_group += 1;
                (group, parts.len() == self.comms.ranks)
            }
            // The other ranks end their groups in their own time: the n-th group of every rank
            // is one collective.
            Some(joined) => {
                let seq = joined.next.fetch_add(1, Ordering::Relaxed);
                let shape = (first.count, first.dtype, first.kind);
                let next = s.next_group;
                let entry = s
                    .joined_groups
                    .entry((joined.key, seq))
                    .or_insert(JoinedGroup {
                        group: next,
                        queued: 0,
                        shape,
                    });
                if entry.shape != shape {
                    return Err(nccl(
                        CALL,
                        INVALID_USAGE,
                        "ncclInvalidUsage: the ranks' calls differ".into(),
                    ));
                }
                entry.queued += 1;
                let group = entry.group;
                if entry.queued == joined.world {
                    s.joined_groups.remove(&(joined.key, seq));
                }
                if group == next {
                    s.next_group += 1;
                }
                (group, true)
            }
        };
        for (stream, mut part) in parts {
            part.group = group_id;
            part.complete = complete;
            s.push(stream, Job::Collective(part));
        }
        drop(s);
        // Ranks on other threads may be waiting for this part.
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

impl State {
    /// The compute stream a raw stream handle names (see `SimDriver::stream_handle`: this
    /// machine's tag in the low bits, the driver's first stream above them), if it is one of this
    /// machine's.
    fn compute_stream_of(&self, handle: u64) -> Option<StreamId> {
        let base = usize::try_from(handle >> 32).ok()?;
        if handle & 0xffff_ffff != (self.instance << 8 | 1) || base >= self.next_stream {
            return None;
        }
        Some(base + Lane::Compute.index())
    }

    /// What the part at a stream's head waits for: nothing once every part of its collective is
    /// at the head of its stream, else the first part that is not (or a number never given out,
    /// should a part be missing: then nothing can run it).
    pub(super) fn collective_blocked_on(&self, part: &Part) -> Option<u64> {
        if !part.complete {
            return None; // it fails alone
        }
        let ours = |job: &Job| matches!(job, Job::Collective(p) if p.group == part.group);
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
        if !part.complete {
            self.failed_streams
                .insert(stream, DriverError::LAUNCH_FAILED);
            return;
        }
        let mut parts = vec![(seq, stream, part)];
        let heads: Vec<StreamId> = self
            .streams
            .iter()
            .filter(|(_, queue)| {
                matches!(queue.front(), Some((_, Job::Collective(p))) if p.group == part.group)
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
        parts.sort_by_key(|&(_, _, p)| p.rank);
        let bytes = part.count * part.dtype.size_bytes();
        let mut inputs = Vec::with_capacity(parts.len());
        for &(seq, stream, p) in &parts {
            self.running = Some(Running {
                seq,
                kind: "collective",
                stream,
            });
            self.access(p.ptr, false);
            match self.block_mut(p.ptr, bytes) {
                Some(block) => inputs.push(block.to_vec()),
                None => {
                    let (driver, lane) = driver_lane(stream);
                    self.violations.push(Violation::UnmappedCollective {
                        driver,
                        lane,
                        ptr: p.ptr,
                        bytes,
                    });
                    return;
                }
            }
        }
        let result = match part.kind {
            CollectiveKind::Broadcast { root } => inputs[root].clone(),
            CollectiveKind::AllReduce(op) => reduce(part.dtype, op, &inputs),
        };
        for &(seq, stream, p) in &parts {
            self.running = Some(Running {
                seq,
                kind: "collective",
                stream,
            });
            self.access(p.ptr, true);
            if let Some(block) = self.block_mut(p.ptr, bytes) {
                block.copy_from_slice(&result);
            }
        }
        // The other parts complete with this one (the caller counts this one).
        for &(other, _, _) in &parts[..] {
            if other == seq {
                continue;
            }
            self.completed_jobs += 1;
            if let Some(wakes) = self.wakes.remove(&other) {
                self.woken.extend(wakes);
            }
        }
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
