//! Collectives on the simulated machine: every rank's part queued in one call, run together
//! once each has reached the head of its stream, as a collective library's kernels meet on
//! the device.

use super::{driver_lane, DevicePtr, DriverError, Job, Running, State, StreamId, Violation};
use crate::driver::{CollectiveKind, CollectiveRank, Reduction};
use crate::dtype::DType;

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
}

impl State {
    /// Queues every rank's part of a collective, each on its stream, or refuses them all.
    pub(super) fn queue_collective(
        &mut self,
        ranks: &[CollectiveRank],
        count: usize,
        dtype: DType,
        kind: CollectiveKind,
    ) -> Result<(), DriverError> {
        if ranks.is_empty() || matches!(dtype, DType::I16 | DType::U16 | DType::Bool) {
            return Err(DriverError::NOT_SUPPORTED);
        }
        if let CollectiveKind::Broadcast { root } = kind {
            if root >= ranks.len() {
                return Err(DriverError::INVALID_VALUE);
            }
        }
        let bytes = count
            .checked_mul(dtype.size_bytes())
            .ok_or(DriverError::INVALID_VALUE)?;
        let mut streams: Vec<StreamId> = Vec::with_capacity(ranks.len());
        for rank in ranks {
            // A compute stream's handle (see `SimDriver::stream_handle`): this machine's tag in
            // the low bits, the driver's first stream above them.
            let base =
                usize::try_from(rank.stream >> 32).map_err(|_| DriverError::INVALID_VALUE)?;
            if rank.stream & 0xffff_ffff != (self.instance << 8 | 1) || base >= self.next_stream {
                return Err(DriverError::INVALID_VALUE);
            }
            let stream = base + crate::driver::Lane::Compute.index();
            if streams.contains(&stream) || self.block_mut(rank.ptr, bytes).is_none() {
                return Err(DriverError::INVALID_VALUE);
            }
            self.refuse_in_capture(stream)?;
            streams.push(stream);
        }
        let group = self.next_group;
        self.next_group += 1;
        for (i, (rank, &stream)) in ranks.iter().zip(&streams).enumerate() {
            let part = Part {
                group,
                rank: i,
                ranks: ranks.len(),
                ptr: rank.ptr,
                count,
                dtype,
                kind,
            };
            self.push(stream, Job::Collective(part));
        }
        Ok(())
    }

    /// What the part at a stream's head waits for: nothing once every part of its collective is
    /// at the head of its stream, else the first part that is not (or a number never given out,
    /// should a part be missing: then nothing can run it).
    pub(super) fn collective_blocked_on(&self, part: &Part) -> Option<u64> {
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
        ($t:ty, $size:expr, $from:expr, $to:expr, $add:expr, $mul:expr, $div:expr) => {{
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
        ($t:ty, $size:expr) => {
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
        ($t:ty, $size:expr) => {
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
