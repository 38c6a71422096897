//! Saving a checkpoint: device → pinned staging → file, the writes overlapped with the
//! downloads, under a temporary name until the file is complete.
//!
//! The layout is the format's own serializer's: tensors sorted by descending alignment of their
//! element types, then by name, the header padded with spaces to a multiple of 8 bytes, so a file this writes is
//! byte for byte the file `safetensors::serialize` writes for the same tensors. The bytes move
//! through staging leases, as a load's do: a window of `ring_depth` leases, each downloading a
//! chunk, then, once its copy is proven, written at its place in the file by a positioned write.
//! The file is written as `<name>.partial` beside the final name, flushed to the storage, and
//! renamed only when every byte is there, so a failure never leaves a truncated checkpoint under
//! the final name (the partial file is removed).

use super::load::Tensor;
use super::{Progress, Tally, header};
use crate::core::engine::CudaEngine;
use crate::error::{CheckpointError, Error, Result};
use crate::lifecycle::lease::{Proven, StagingLease, Unproven, released};
use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The header bytes (padded) and each tensor's place, for `tensors` in the format's order.
fn layout(
    path: &Path,
    tensors: &mut [(String, &Tensor)],
) -> Result<(Vec<u8>, Vec<u64>), CheckpointError> {
    // The format's order: its dtypes by descending alignment (its enum's order), then names.
    tensors.sort_by(|(ln, l), (rn, r)| {
        header::format_dtype(r.dtype())
            .cmp(&header::format_dtype(l.dtype()))
            .then(ln.cmp(rn))
    });
    let mut offset = 0usize;
    let mut infos = Vec::with_capacity(tensors.len());
    let mut starts = Vec::with_capacity(tensors.len());
    for (name, t) in tensors.iter() {
        let n = t.bytes().len();
        infos.push((
            name.clone(),
            safetensors::tensor::TensorInfo {
                dtype: header::format_dtype(t.dtype()),
                shape: t.shape().to_vec(),
                data_offsets: (offset, offset + n),
            },
        ));
        starts.push(offset as u64);
        offset += n;
    }
    let bad = |reason: String| CheckpointError::Header {
        path: path.to_owned(),
        tensor: None,
        reason,
    };
    let metadata =
        safetensors::tensor::Metadata::new(None, infos).map_err(|e| bad(e.to_string()))?;
    let mut json = serde_json::to_string(&metadata)
        .map_err(|e| bad(e.to_string()))?
        .into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    let data_start = out.len() as u64;
    Ok((out, starts.into_iter().map(|s| s + data_start).collect()))
}

/// The partial file's name: `<file name>.partial` beside `path`.
fn partial(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

/// Writes `tensors` (names with their tensors, of `engine`) to the safetensors file `path`.
///
/// # Errors
/// [`Error::Checkpoint`] when the file cannot be created, written, flushed or renamed (the
/// partial file is then removed, and nothing is left under `path`), or for a name given twice;
/// the engine's error when a download or its proof fails.
pub(crate) fn save(
    engine: &mut CudaEngine,
    path: &Path,
    tensors: &[(&str, &Tensor)],
    progress: &mut dyn FnMut(Progress),
) -> Result<()> {
    let mut names = std::collections::HashSet::new();
    for (name, _) in tensors {
        if !names.insert(*name) {
            return Err(CheckpointError::Header {
                path: path.to_owned(),
                tensor: Some((*name).to_owned()),
                reason: "the name is given twice".into(),
            }
            .into());
        }
    }
    let mut ordered: Vec<(String, &Tensor)> =
        tensors.iter().map(|(n, t)| ((*n).to_owned(), *t)).collect();
    let (head, starts) = layout(path, &mut ordered)?;
    let temporary = partial(path);
    let io = |operation: &'static str| {
        let path = temporary.clone();
        move |source| CheckpointError::Io {
            path,
            operation,
            source,
        }
    };
    let file = File::create(&temporary).map_err(io("create"))?;
    let total = ordered.iter().map(|(_, t)| t.bytes().len() as u64).sum();
    let mut tally = Tally::new(total, progress);
    let written = write_all(
        engine, &file, &temporary, &head, &ordered, &starts, &mut tally,
    )
    .and_then(|()| file.sync_all().map_err(io("flush")).map_err(Error::from));
    drop(file);
    let renamed = written.and_then(|()| {
        std::fs::rename(&temporary, path)
            .map_err(io("rename"))
            .map_err(Error::from)
    });
    if renamed.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    renamed
}

/// One chunk of the save: bytes `at..at + len` of tensor `tensor`, to file offset `offset`.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    tensor: usize,
    at: usize,
    len: usize,
    offset: u64,
}

/// Writes the header, then every tensor's bytes through a window of staging leases.
fn write_all(
    engine: &mut CudaEngine,
    file: &File,
    path: &Path,
    head: &[u8],
    tensors: &[(String, &Tensor)],
    starts: &[u64],
    tally: &mut Tally<'_>,
) -> Result<()> {
    let write = |bytes: &[u8], offset: u64| -> Result<(), CheckpointError> {
        file.write_all_at(bytes, offset)
            .map_err(|source| CheckpointError::Io {
                path: path.to_owned(),
                operation: "write",
                source,
            })
    };
    write(head, 0)?;
    let depth = engine.staging_config().ring_depth.max(2);
    let first = engine.staging_lease()?;
    let capacity = first.capacity();
    let mut free: Vec<StagingLease<Proven>> = vec![first];
    let mut plan = Vec::new();
    for (i, ((_, t), &start)) in tensors.iter().zip(starts).enumerate() {
        let mut at = 0;
        while at < t.bytes().len() {
            let len = capacity.min(t.bytes().len() - at);
            plan.push(Chunk {
                tensor: i,
                at,
                len,
                offset: start + at as u64,
            });
            at += len;
        }
    }
    let mut flying: VecDeque<(StagingLease<Unproven>, Chunk)> = VecDeque::new();
    // Proves the oldest download, writes its bytes, and returns its lease.
    let mut land =
        |flying: &mut VecDeque<(StagingLease<Unproven>, Chunk)>| -> Result<StagingLease<Proven>> {
            let (lease, chunk) = flying.pop_front().expect("a download in flight");
            let lease = lease.end_chunk()?;
            write(&lease.as_bytes()[..chunk.len], chunk.offset)?;
            tally.add(chunk.len as u64);
            Ok(lease)
        };
    for chunk in plan {
        let lease = match free.pop() {
            Some(lease) => lease,
            None if flying.len() < depth => match engine.staging_lease() {
                Ok(lease) => lease,
                Err(Error::Staging(crate::error::StagingError::Exhausted { .. }))
                    if !flying.is_empty() =>
                {
                    land(&mut flying)?
                }
                Err(error) => return Err(error),
            },
            None => land(&mut flying)?,
        };
        let source = tensors[chunk.tensor].1.bytes();
        match lease.begin_download(engine, source, chunk.at, chunk.len) {
            Ok(unproven) => flying.push_back((unproven, chunk)),
            Err(refused) => return Err(released(refused)),
        }
    }
    while !flying.is_empty() {
        free.push(land(&mut flying)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::load::tests::{checkpoint, engine, load_all};
    use super::*;
    use crate::driver::sim::SimOp;
    use crate::error::DriverError;

    /// The checkpoint's tensors, loaded onto `engine`.
    fn loaded(engine: &mut CudaEngine) -> Vec<(String, Tensor)> {
        let (bytes, _) = checkpoint();
        load_all(engine, &&bytes[..], bytes.len() as u64).unwrap()
    }

    #[test]
    fn a_saved_file_is_byte_for_byte_the_formats_own_and_nothing_partial_is_left() {
        let (bytes, _) = checkpoint();
        let (mut engine, sim) = engine();
        let tensors = loaded(&mut engine);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        save(&mut engine, &path, &named, &mut |_| {}).unwrap();
        let written = std::fs::read(&path).unwrap();
        assert_eq!(
            written, bytes,
            "the format's serializer writes the same bytes"
        );
        let read = safetensors::SafeTensors::deserialize(&written).unwrap();
        assert_eq!(read.len(), 4);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["model.safetensors"], "no partial file left");
        drop(tensors);
        engine.synchronize().unwrap();
        assert!(sim.violations().is_empty(), "{:?}", sim.violations());
    }

    #[test]
    fn a_name_given_twice_is_refused_before_any_file_is_made() {
        let (mut engine, _sim) = engine();
        let tensors = loaded(&mut engine);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let twice = [("a", &tensors[0].1), ("a", &tensors[1].1)];
        let err = save(&mut engine, &path, &twice, &mut |_| {}).unwrap_err();
        assert!(err.to_string().contains("'a'"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_fault_at_every_driver_call_of_the_save_leaves_no_file_and_loses_nothing() {
        const OPS: [SimOp; 5] = [
            SimOp::HostAlloc,
            SimOp::CopyDtoH,
            SimOp::EventCreate,
            SimOp::EventRecord,
            SimOp::EventSynchronize,
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let counts: Vec<u64> = {
            let (mut engine, sim) = engine();
            let tensors = loaded(&mut engine);
            let named: Vec<(&str, &Tensor)> =
                tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let before: Vec<u64> = OPS.iter().map(|&op| sim.calls(op)).collect();
            save(&mut engine, &path, &named, &mut |_| {}).unwrap();
            std::fs::remove_file(&path).unwrap();
            OPS.iter()
                .zip(before)
                .map(|(&op, b)| sim.calls(op) - b)
                .collect()
        };
        let mut runs = 0;
        for (&op, &count) in OPS.iter().zip(&counts) {
            for n in 1..=count {
                let (mut engine, sim) = engine();
                let tensors = loaded(&mut engine);
                let named: Vec<(&str, &Tensor)> =
                    tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
                sim.fail_nth(op, n, DriverError::LAUNCH_FAILED);
                match save(&mut engine, &path, &named, &mut |_| {}) {
                    Err(e) if !matches!(e, Error::Checkpoint(_)) => {
                        let left = std::fs::read_dir(dir.path()).unwrap().count();
                        assert_eq!(left, 0, "{op:?} {n}: a file was left");
                    }
                    // A copy proven another way (a stream synchronize, when its event could not
                    // be recorded): the file is whole, and the failure is reported at the next
                    // boundary.
                    Ok(()) => {
                        assert_eq!(std::fs::read(&path).unwrap(), checkpoint().0, "{op:?} {n}");
                        assert!(engine.synchronize().is_err(), "{op:?} {n}: not reported");
                        std::fs::remove_file(&path).unwrap();
                    }
                    other => panic!("{op:?} call {n}: {other:?}"),
                }
                let _ = engine.synchronize();
                sim.clear_faults();
                save(&mut engine, &path, &named, &mut |_| {}).expect("the engine saves again");
                assert_eq!(std::fs::read(&path).unwrap(), checkpoint().0);
                std::fs::remove_file(&path).unwrap();
                drop(named);
                drop(tensors);
                let retained = engine.retirement_stats().retained;
                drop(engine);
                assert!(sim.violations().is_empty(), "{:?}", sim.violations());
                if retained == 0 {
                    assert_eq!(sim.device_live().0, 0);
                    assert_eq!(sim.pinned_live().0, 0);
                }
                runs += 1;
            }
        }
        assert!(runs >= 8, "{runs} runs");
    }
}
