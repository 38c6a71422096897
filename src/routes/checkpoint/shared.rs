//! Reading a checkpoint once for every rank of a communicator: each rank reads its share of
//! the file from storage, and the ranks exchange what they read through the collectives.
//!
//! Where storage is slower than the links between GPUs (a cold disk reads a few GiB/s; NVLink
//! and NCCL move hundreds), a world whose ranks each load the whole file reads it `world` times
//! over, and every rank waits on the disk for all of it. Here the tensors are split between the
//! ranks by their bytes, each rank reads its share (a contiguous stretch of the file) through
//! the usual pipeline, and a broadcast from the rank that read each tensor gives it to the
//! others, so the file is read from storage once in total.

use super::load;
use super::{Checkpoint, Filling, LoadOptions, Tally, converted, plan_shards};
use crate::core::engine::CudaEngine;
use crate::error::{Result, UsageError};
use crate::memory::any_tensor::AnyTensor;
use crate::memory::tensor::DeviceTensor;
use crate::routes::collective::Communicator;
use std::path::Path;
use std::sync::Arc;

/// The most broadcasts one collective group holds: a checkpoint of thousands of tensors is
/// exchanged in groups of this many, each waited for before the next is queued.
const GROUP: usize = 256;

/// Loads every selected tensor of the checkpoint `path` onto every rank of `comm` in this
/// process (`engines`, one per rank, in the communicator's order), reading each byte of the
/// file from storage once across the whole world: the tensors are split between the world's
/// ranks by their bytes (rank `r` reads the `r`-th contiguous stretch of roughly
/// `1 / world` of them), each rank reads its share through the usual pipeline, and a broadcast
/// from the rank that read a tensor hands it to every other rank. Returns one [`Checkpoint`] per
/// engine, each holding every selected tensor, once every broadcast is complete.
///
/// Every rank of the world must call it with the same file and the same selection and
/// conversion (ranks in other processes make their own call, with their own engine): the
/// split and the order of the broadcasts follow from the file's header, so ranks that read
/// the same file make the same collective calls. `options`' staging, `progress` (the bytes
/// this process reads), `select` and `convert` apply; `slices` does not (every rank receives
/// every selected tensor whole).
///
/// # Errors
/// As [`load_with`](super::load_with); [`UsageError::RankCount`] when `engines` are not as many
/// as `comm`'s ranks here; [`UsageError::NotTaken`] for options with `slices`; the
/// collectives' errors ([`Error::Peer`](crate::Error::Peer) for a peer that died or the
/// communicator's deadline passed, as every collective of joined ranks). A rank that fails
/// before its broadcasts leaves the other ranks waiting for them until their deadline.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # use cuferry::sim::{SimConfig, SimDevice};
/// # use cuferry::{checkpoint, download_tensor, upload_tensor, CudaEngine};
/// # use cuferry::collective::Communicator;
/// # let sim = SimDevice::new(SimConfig { devices: 2, ..SimConfig::default() });
/// # let mut gpu0 = CudaEngine::simulated_on_device(&sim, 0)?;
/// # let mut gpu1 = CudaEngine::simulated_on_device(&sim, 1)?;
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("model.safetensors");
/// # let a = upload_tensor(&mut gpu0, &[1f32, 2.], &[2])?;
/// # let b = upload_tensor(&mut gpu0, &[3f32, 4.], &[2])?;
/// # checkpoint::save(&mut gpu0, &[("a", &a), ("b", &b)], &path)?;
/// let comm = Communicator::new(&mut [&mut gpu0, &mut gpu1])?;
/// let engines = &mut [&mut gpu0, &mut gpu1];
/// let [mut on0, mut on1]: [_; 2] =
///     checkpoint::load_shared(&comm, engines, &path, checkpoint::LoadOptions::new())?
///         .try_into()
///         .unwrap();
/// // Rank 0 read `a`, rank 1 read `b`; each has both.
/// let b = on0.take::<f32>("b")?;
/// assert_eq!(download_tensor(&mut gpu0, &b)?, [3., 4.]);
/// let a = on1.take::<f32>("a")?;
/// assert_eq!(download_tensor(&mut gpu1, &a)?, [1., 2.]);
/// # Ok(()) }
/// ```
pub fn load_shared(
    comm: &Communicator,
    engines: &mut [&mut CudaEngine],
    path: impl AsRef<Path>,
    mut options: LoadOptions<'_>,
) -> Result<Vec<Checkpoint>> {
    let path = path.as_ref();
    if engines.len() != comm.ranks() {
        return Err(UsageError::RankCount {
            ranks: comm.ranks(),
            engines: engines.len(),
            tensors: 0,
        }
        .into());
    }
    if options.sliced {
        return Err(UsageError::NotTaken {
            operation: "checkpoint::load_shared",
            setting: "slices",
            instead: "every rank receives every selected tensor whole; load slices with \
                      load_with on each rank",
        }
        .into());
    }
    let staging = options.staging.validate("readers")?;
    let shards = plan_shards(path, &mut options, staging)?;
    // Every planned tensor, in file order across the shards: its shard and its place there.
    let planned: Vec<(usize, usize)> = shards
        .iter()
        .enumerate()
        .flat_map(|(s, shard)| (0..shard.tensors.len()).map(move |i| (s, i)))
        .collect();
    let bytes = |&(s, i): &(usize, usize)| {
        let t = &shards[s].tensors[i];
        t.end - t.start
    };
    let readers = owners(&planned.iter().map(bytes).collect::<Vec<_>>(), comm.world());
    let first = comm.rank();
    let mine: u64 = planned
        .iter()
        .zip(&readers)
        .filter(|&(_, &r)| r >= first && r < first + engines.len())
        .map(|(p, _)| bytes(p))
        .sum();
    let mut tally = Tally::new(mine, &mut *options.progress);
    // Each rank here: its tensors' bytes, read by it or allocated for a broadcast into them.
    let mut held: Vec<Vec<Option<DeviceTensor<u8>>>> = Vec::with_capacity(engines.len());
    for (k, engine) in engines.iter_mut().enumerate() {
        let rank = first + k;
        let mut tensors: Vec<Option<DeviceTensor<u8>>> = Vec::with_capacity(planned.len());
        for (s, shard) in shards.iter().enumerate() {
            let base = place(&planned, s);
            let reads = |i: usize| readers[base + i] == rank;
            let entries: Vec<_> = (0..shard.tensors.len())
                .filter(|&i| reads(i))
                .map(|i| shard.tensors[i].clone())
                .collect();
            let mut read = load::load_bytes(engine, shard.source(), &entries, staging, &mut tally)?
                .into_iter();
            for (i, t) in shard.tensors.iter().enumerate() {
                tensors.push(Some(if reads(i) {
                    read.next().expect("one tensor per read entry")
                } else {
                    engine.alloc_tensor::<u8>(&[(t.end - t.start) as usize])?
                }));
            }
        }
        held.push(tensors);
    }
    // The broadcasts, a group at a time: tensor `j` from the rank that read it.
    let sent: Vec<usize> = (0..planned.len())
        .filter(|&j| bytes(&planned[j]) > 0)
        .collect();
    for batch in sent.chunks(GROUP) {
        let mut group = comm.group::<u8>();
        for &j in batch {
            let tensors = held
                .iter_mut()
                .map(|rank| rank[j].take().expect("each tensor is sent once"))
                .collect();
            group = group.broadcast(tensors, readers[j]);
        }
        let done = group
            .submit(engines)
            .map_err(|refused| refused.into_error())?
            .wait()?
            .into_parts();
        let mut done = done.into_iter();
        for &j in batch {
            for rank in held.iter_mut() {
                rank[j] = Some(done.next().expect("one tensor per rank and call"));
            }
        }
    }
    // Typed, converted where asked, and put in file order, on each rank.
    let files: Vec<Arc<Path>> = shards.iter().map(|s| s.path.as_path().into()).collect();
    let convert = &mut *options.convert;
    let mut out = Vec::with_capacity(engines.len());
    for (engine, tensors) in engines.iter_mut().zip(held) {
        let mut filling = Filling::new(planned.len());
        for ((j, bytes), &(s, i)) in tensors.into_iter().enumerate().zip(&planned) {
            let entry = &shards[s].tensors[i];
            let bytes = bytes.expect("every tensor came back");
            // SAFETY: the bytes are the file's bytes of this tensor: read by this rank (its
            // reader refused a `bool` byte other than 0 or 1 before the copy was queued) or
            // broadcast, byte for byte, from the rank that read them; every copy and broadcast
            // into them is complete (waited for above), and later work is ordered after them.
            let tensor = unsafe { AnyTensor::from_bytes(bytes, entry.dtype, &entry.shape) }
                .expect("the header checked that the shape fills the tensor's bytes");
            let tensor = converted(engine, &mut *convert, &entry.name, tensor)?;
            filling.put(j, &files[s], entry.name.clone(), tensor);
        }
        out.push(filling.done());
    }
    Ok(out)
}

/// The index in `planned` of the first tensor of shard `s`.
fn place(planned: &[(usize, usize)], s: usize) -> usize {
    planned.partition_point(|&(shard, _)| shard < s)
}

/// The rank that reads each of tensors of `bytes` (in file order) in a world of `world`: the
/// file cut into `world` stretches of equal bytes, each tensor read by the rank whose stretch
/// holds its middle byte, so each rank reads one contiguous stretch.
fn owners(bytes: &[u64], world: usize) -> Vec<usize> {
    let total: u128 = bytes.iter().map(|&b| u128::from(b)).sum::<u128>().max(1);
    let mut before = 0u128;
    bytes
        .iter()
        .map(|&b| {
            let middle = before + u128::from(b) / 2;
            before += u128::from(b);
            ((middle * world as u128 / total) as usize).min(world - 1)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::owners;

    #[test]
    fn the_ranks_read_contiguous_stretches_of_equal_bytes() {
        assert_eq!(owners(&[10; 8], 4), [0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(owners(&[10; 3], 8), [1, 4, 6]);
        assert_eq!(owners(&[100, 1, 1, 1, 100], 2), [0, 0, 0, 1, 1]);
        assert_eq!(owners(&[0, 0], 3), [0, 0]);
        assert_eq!(owners(&[u64::MAX, u64::MAX], 2), [0, 1]);
        assert_eq!(owners(&[], 2), Vec::<usize>::new());
        // Every rank of a world no larger than the tensors reads one.
        let spread = owners(&[7; 16], 8);
        assert!((0..8).all(|r| spread.contains(&r)), "{spread:?}");
    }
}
