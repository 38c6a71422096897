//! Sharded checkpoints: a `model.safetensors.index.json` whose `weight_map` names, for each
//! tensor, the shard file (beside the index) that holds it.
//!
//! Every shard's header is read and checked before anything is allocated, so a missing shard,
//! a shard that lacks a tensor the index gives it, or a bad shard is found first, and the
//! progress report knows the total from the start. The shards then load one after another, each
//! through the same pipeline as a single file.

use super::header::{Entries, Entry};
use super::load as pipeline;
use super::{Shard, file_len, open, open_direct, retry};
use crate::error::{IoError, MalformedError, Result};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// A shard read for the plan: its path, the file opened, its length, and the tensors of its
/// header that the index places there, in file order.
type Read = (std::path::PathBuf, std::fs::File, u64, Vec<Entry>);

/// The most threads that read the shards' headers at once.
const MAX_PLAN_THREADS: usize = 8;

/// The largest index file read, in bytes: the header's limit (an index names each tensor once,
/// as a header does, in fewer bytes).
pub(crate) const MAX_INDEX: u64 = super::header::MAX_HEADER;

/// The index file's shape: the weight map, and whatever else it holds (ignored; a field given
/// twice is refused).
#[derive(serde::Deserialize)]
struct Index<'a> {
    /// Each tensor's shard, entry by entry as written.
    #[serde(borrow)]
    weight_map: Entries<Text<'a>>,
}

/// A string of the index: borrowed from its text where it holds no escape, made otherwise.
struct Text<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
        }
        deserializer.deserialize_str(Visit)
    }
}

/// The bytes of the index `path`, read through a bounded reader: at most [`MAX_INDEX`] (a
/// longer file, a device without end such as `/dev/zero`, is refused after `MAX_INDEX + 1`
/// bytes, or at once where the file's length says so).
fn read_index(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let too_large = || MalformedError::TooLarge {
        path: path.to_owned(),
        what: "the index",
        limit: MAX_INDEX,
    };
    let file = open(path)?;
    if file_len(path, &file)? > MAX_INDEX {
        return Err(too_large().into());
    }
    let mut bytes = Vec::new();
    // `read_to_end` retries `Interrupted`.
    (&file)
        .take(MAX_INDEX + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| IoError::File {
            path: path.to_owned(),
            operation: "read",
            source,
        })?;
    if bytes.len() as u64 > MAX_INDEX {
        return Err(too_large().into());
    }
    Ok(bytes)
}

/// The shards of the sharded checkpoint whose index is `path`, each opened and checked, with
/// the tensors the index places there that `select` accepts; each also opened for direct
/// reads, where `direct` asks for them.
///
/// The work is linear in the tensors and shards named (hashed look-ups, no scans).
pub(super) fn plan(
    path: &Path,
    select: &mut dyn FnMut(&str) -> bool,
    direct: bool,
) -> Result<Vec<Shard>> {
    let bad = |tensor: Option<String>, reason: String| MalformedError::Header {
        path: path.to_owned(),
        tensor,
        reason,
    };
    let bytes = read_index(path)?;
    let text = std::str::from_utf8(&bytes).map_err(|e| bad(None, format!("not UTF-8: {e}")))?;
    let Index { weight_map } =
        serde_json::from_str(text).map_err(|e| bad(None, format!("not an index: {e}")))?;
    // The shards in the order first named, how many tensors each must hold, and each name's
    // shard (a name given twice is refused): one hashed look-up a name, the shard's skipped
    // where it is the one before's, as an index written shard by shard has it.
    let mut shards: Vec<(&str, usize)> = Vec::new();
    let mut place: HashMap<&str, usize> = HashMap::new();
    let mut shard_of: HashMap<&str, usize> = HashMap::with_capacity(weight_map.0.len());
    let mut last: Option<(&str, usize)> = None;
    for (name, Text(shard)) in &weight_map.0 {
        let name = name.as_str();
        if shard.contains('/') || shard.contains('\\') || shard == ".." {
            return Err(bad(
                Some(name.to_owned()),
                format!("shard {shard:?} is not a file beside the index"),
            )
            .into());
        }
        let at = match last {
            Some((s, at)) if s == shard.as_ref() => at,
            _ => *place.entry(shard.as_ref()).or_insert_with(|| {
                shards.push((shard.as_ref(), 0));
                shards.len() - 1
            }),
        };
        last = Some((shard.as_ref(), at));
        if shard_of.insert(name, at).is_some() {
            return Err(bad(Some(name.to_owned()), "the name is given twice".into()).into());
        }
        shards[at].1 += 1;
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    // Each shard's header read and checked against the index, the shards on threads of their
    // own (a set of many shards is read in parallel); the errors in the index's order.
    let read = |at: usize| -> Result<Read> {
        let (shard, count) = shards[at];
        let shard_path = dir.join(shard);
        let missing = || MalformedError::MissingShard {
            index: path.to_owned(),
            shard: shard_path.clone(),
        };
        match retry(|| std::fs::metadata(&shard_path)) {
            Ok(m) if m.is_file() => {}
            Ok(_) => return Err(missing().into()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(missing().into()),
            Err(source) => {
                return Err(IoError::File {
                    path: shard_path,
                    operation: "stat",
                    source,
                }
                .into());
            }
        }
        let file = open(&shard_path)?;
        let len = file_len(&shard_path, &file)?;
        let everything = pipeline::plan(&shard_path, &file, len, &mut |_| true)?;
        // The tensors the index places here (each once: the header refuses a name given
        // twice), all of them, or an error naming the first the index places here in vain.
        let placed: Vec<Entry> = everything
            .into_iter()
            .filter(|t| shard_of.get(t.name.as_str()) == Some(&at))
            .collect();
        if placed.len() != count {
            let present: HashSet<&str> = placed.iter().map(|t| t.name.as_str()).collect();
            let absent = weight_map
                .0
                .iter()
                .find(|(n, _)| shard_of[n.as_str()] == at && !present.contains(n.as_str()))
                .map(|(n, _)| n.clone())
                .unwrap_or_default();
            return Err(MalformedError::Header {
                path: shard_path,
                tensor: Some(absent),
                reason: format!(
                    "the index {} places the tensor here; the shard lacks it",
                    path.display()
                ),
            }
            .into());
        }
        Ok((shard_path, file, len, placed))
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, MAX_PLAN_THREADS)
        .min(shards.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut reads: Vec<Option<Result<Read>>> = (0..shards.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let at = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if at >= shards.len() {
                            break done;
                        }
                        let result = read(at);
                        let failed = result.is_err();
                        done.push((at, result));
                        if failed {
                            // The later shards are not needed: the plan fails.
                            next.fetch_max(shards.len(), std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for worker in workers {
            let done = worker
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            for (at, result) in done {
                reads[at] = Some(result);
            }
        }
    });
    let mut plans = Vec::with_capacity(shards.len());
    for read in reads {
        // A shard left unread follows one that failed, whose error comes first.
        let Some(read) = read else { break };
        let (shard_path, file, len, placed) = read?;
        let tensors: Vec<_> = placed.into_iter().filter(|t| select(&t.name)).collect();
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
