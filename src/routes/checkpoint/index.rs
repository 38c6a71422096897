//! Sharded checkpoints: a `model.safetensors.index.json` whose `weight_map` names, for each
//! tensor, the shard file (beside the index) that holds it.
//!
//! Every shard's header is read and checked before anything is allocated, so a missing shard,
//! a shard that lacks a tensor the index gives it, or a bad shard is found first, and the
//! progress report knows the total from the start. The shards then load one after another, each
//! through the same pipeline as a single file.

use super::header::Entries;
use super::load as pipeline;
use super::{Shard, file_len, open, open_direct};
use crate::error::{CheckpointError, Result};
use std::path::Path;

/// The index file's shape: the weight map, and whatever else it holds (ignored).
#[derive(serde::Deserialize)]
struct Index {
    /// Each tensor's shard, entry by entry as written.
    weight_map: Entries<String>,
}

/// The shards of the sharded checkpoint whose index is `path`, each opened and checked, with
/// the tensors the index places there that `select` accepts; each also opened for direct
/// reads, where `direct` asks for them.
pub(super) fn plan(
    path: &Path,
    select: &mut dyn FnMut(&str) -> bool,
    direct: bool,
) -> Result<Vec<Shard>> {
    let bad = |tensor: Option<String>, reason: String| CheckpointError::Header {
        path: path.to_owned(),
        tensor,
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|source| CheckpointError::Io {
        path: path.to_owned(),
        operation: "read",
        source,
    })?;
    let Index { weight_map } =
        serde_json::from_str(&text).map_err(|e| bad(None, format!("not an index: {e}")))?;
    if let Some(name) = weight_map.repeated() {
        return Err(bad(Some(name.to_owned()), "the name is given twice".into()).into());
    }
    // The shards in the order first named, each with the tensors it must hold.
    let mut shards: Vec<(String, Vec<String>)> = Vec::new();
    for (name, shard) in weight_map.0 {
        if shard.contains('/') || shard.contains('\\') || shard == ".." {
            return Err(bad(
                Some(name),
                format!("shard {shard:?} is not a file beside the index"),
            )
            .into());
        }
        match shards.iter_mut().find(|(s, _)| *s == shard) {
            Some((_, names)) => names.push(name),
            None => shards.push((shard, vec![name])),
        }
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut plans = Vec::with_capacity(shards.len());
    for (shard, names) in &shards {
        let shard_path = dir.join(shard);
        if !shard_path.is_file() {
            return Err(CheckpointError::MissingShard {
                index: path.to_owned(),
                shard: shard_path,
            }
            .into());
        }
        let file = open(&shard_path)?;
        let len = file_len(&shard_path, &file)?;
        let everything = pipeline::plan(&shard_path, &file, len, &mut |_| true)?;
        if let Some(absent) = names
            .iter()
            .find(|n| !everything.iter().any(|t| &t.name == *n))
        {
            return Err(CheckpointError::Header {
                path: shard_path,
                tensor: Some(absent.clone()),
                reason: format!(
                    "the index {} places the tensor here; the shard lacks it",
                    path.display()
                ),
            }
            .into());
        }
        let tensors: Vec<_> = everything
            .into_iter()
            .filter(|t| names.contains(&t.name) && select(&t.name))
            .collect();
        let direct = direct.then(|| open_direct(&shard_path)).flatten();
        plans.push(Shard {
            path: shard_path,
            file,
            direct,
            len,
            tensors,
        });
    }
    Ok(plans)
}
