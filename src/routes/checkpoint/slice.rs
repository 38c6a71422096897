//! Slices per rank: which part of each tensor a load takes, and the plan of reads that takes
//! only those bytes.
//!
//! Served models are split across ranks, one process per GPU, each holding a slice of every
//! large weight. A load that reads every byte and keeps a slice reads the file `world` times
//! over; this module turns a slice into the file ranges that hold it, so each rank reads only
//! its share: a range of rows (dimension 0) is one contiguous range of the file, and a range of
//! columns (the last dimension) is one run per row, `stride` bytes apart, which the pipeline
//! reads run by run into one staging slot and copies to the device as the compact slice.

use super::header::Entry;
use crate::error::{Result, UsageError};
use std::ops::Range;

/// The part of one tensor a load takes ([`LoadOptions::slices`](super::LoadOptions::slices)).
///
/// The tensor handed out is the slice, compact: rows `a..b` of a `[n, k]` tensor are a
/// `[b - a, k]` tensor, columns `a..b` a `[n, b - a]` one. Only the slice's bytes are read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slice {
    /// The whole tensor.
    Whole,
    /// The rows `range` of dimension 0: one contiguous range of the file.
    Rows(Range<usize>),
    /// The columns `range` of the last dimension: one run of `range.len()` elements per row,
    /// read as one positioned read each (the whole tensor is never read).
    Columns(Range<usize>),
    /// Nothing: the tensor is neither allocated nor read.
    Skip,
}

/// Which dimension a [`TensorParallel`] rule splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dim {
    Rows,
    Columns,
}

/// The usual tensor-parallel split of a checkpoint: rank `rank` of `world` takes its share of
/// each tensor whose name a rule's pattern matches, by rows or by columns, and the other
/// tensors whole (norms, biases of row-parallel layers, embeddings left replicated).
///
/// A pattern is a name with `*` standing for any run of characters (`"*.q_proj.weight"`,
/// `"model.layers.*.mlp.down_proj.weight"`); the first rule that matches a name decides. A
/// split divides the dimension into `world` equal ranges, rank `r` taking the `r`-th; a
/// dimension that `world` does not divide is refused
/// ([`UsageError::UnevenSplit`](crate::error::UsageError::UnevenSplit)) unless
/// [`uneven`](Self::uneven) allows it, when the ranges differ by at most one (rank `r` takes
/// `r * n / world .. (r + 1) * n / world`). A scalar matched by a rule is taken whole: it has
/// no dimension to split.
///
/// ```
/// use cuferry::checkpoint::{Slice, TensorParallel};
/// // Megatron's split of a transformer layer, rank 1 of 4.
/// let plan = TensorParallel::new(1, 4)?
///     .rows("*.q_proj.weight") // column-parallel: output features are rows of [out, in]
///     .columns("*.o_proj.weight"); // row-parallel: input features are columns
/// assert_eq!(plan.slice("layers.0.q_proj.weight", &[4096, 4096])?, Slice::Rows(1024..2048));
/// assert_eq!(plan.slice("layers.0.o_proj.weight", &[4096, 4096])?, Slice::Columns(1024..2048));
/// assert_eq!(plan.slice("layers.0.norm.weight", &[4096])?, Slice::Whole);
/// # Ok::<(), cuferry::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TensorParallel {
    rank: usize,
    world: usize,
    rules: Vec<(String, Dim)>,
    uneven: bool,
}

impl TensorParallel {
    /// Rank `rank` of a world of `world`, with no rule yet (every tensor whole).
    ///
    /// # Errors
    /// [`UsageError::NotARank`] when `rank >= world` (a world of none included).
    pub fn new(rank: usize, world: usize) -> Result<Self> {
        if rank >= world {
            return Err(UsageError::NotARank { rank, world }.into());
        }
        Ok(TensorParallel {
            rank,
            world,
            rules: Vec::new(),
            uneven: false,
        })
    }

    /// Splits the tensors whose names match `pattern` by rows (dimension 0).
    pub fn rows(mut self, pattern: impl Into<String>) -> Self {
        self.rules.push((pattern.into(), Dim::Rows));
        self
    }

    /// Splits the tensors whose names match `pattern` by columns (the last dimension).
    pub fn columns(mut self, pattern: impl Into<String>) -> Self {
        self.rules.push((pattern.into(), Dim::Columns));
        self
    }

    /// Whether a dimension that the world does not divide is split into ranges that differ by
    /// at most one (`true`), or refused (`false`, the default).
    pub fn uneven(mut self, allow: bool) -> Self {
        self.uneven = allow;
        self
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The world size.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The part of the tensor `name` of shape `shape` this rank takes.
    ///
    /// # Errors
    /// [`UsageError::UnevenSplit`] when the dimension a rule splits is not a multiple of the
    /// world size and uneven splits are not allowed.
    pub fn slice(&self, name: &str, shape: &[usize]) -> Result<Slice> {
        let Some(&(_, dim)) = self.rules.iter().find(|(p, _)| matches(p, name)) else {
            return Ok(Slice::Whole);
        };
        let Some(&last) = shape.last() else {
            return Ok(Slice::Whole); // a scalar: nothing to split
        };
        let (dimension, n) = match dim {
            Dim::Rows => (0, shape[0]),
            Dim::Columns => (shape.len() - 1, last),
        };
        if n % self.world != 0 && !self.uneven {
            return Err(UsageError::UnevenSplit {
                tensor: name.to_owned(),
                dimension,
                size: n,
                world: self.world,
            }
            .into());
        }
        // `n * rank` cannot overflow in practice (a dimension's elements fit in memory), but
        // a shape claims what it likes: the wide product keeps the split exact.
        let at = |r: usize| (n as u128 * r as u128 / self.world as u128) as usize;
        let range = at(self.rank)..at(self.rank + 1);
        Ok(match dim {
            Dim::Rows => Slice::Rows(range),
            Dim::Columns => Slice::Columns(range),
        })
    }
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters (none
/// included) and every other character for itself.
pub(crate) fn matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty(); // no `*`: the whole name
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// A tensor read as runs: `len` bytes every `stride` bytes of the file, the first at the
/// entry's `start`. The entry's `end` is then `start` plus the slice's bytes (the runs'
/// lengths added up), not an offset of the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Runs {
    pub(crate) stride: u64,
    pub(crate) len: u64,
}

impl Runs {
    /// The file offset of byte `at` of the slice that starts at `origin`.
    pub(crate) fn file_offset(self, origin: u64, at: u64) -> u64 {
        origin + at / self.len * self.stride + at % self.len
    }
}

/// What a load asks of each tensor: given its name and shape, the part to take.
pub(crate) type Slicer<'a> = dyn FnMut(&str, &[usize]) -> Result<Slice> + 'a;

/// The planned `entries` of `path`, each cut to the part `slicer` names for it (those it skips
/// dropped).
///
/// # Errors
/// [`UsageError::SliceOutOfRange`] for a range past its dimension (or rows or columns of a
/// scalar); `slicer`'s own error.
pub(crate) fn apply(entries: Vec<Entry>, slicer: &mut Slicer<'_>) -> Result<Vec<Entry>> {
    let mut out = Vec::with_capacity(entries.len());
    for entry in entries {
        let slice = slicer(&entry.name, &entry.shape)?;
        if let Some(entry) = cut(entry, slice)? {
            out.push(entry);
        }
    }
    Ok(out)
}

/// `entry` cut to `slice`: `None` when skipped.
fn cut(mut entry: Entry, slice: Slice) -> Result<Option<Entry>> {
    let out_of_range = |entry: &Entry, slice: &Slice| {
        let (what, range) = match slice {
            Slice::Rows(r) => ("rows", r.clone()),
            Slice::Columns(r) => ("columns", r.clone()),
            Slice::Whole | Slice::Skip => unreachable!("a whole tensor or none always fits"),
        };
        Err(UsageError::SliceOutOfRange {
            tensor: entry.name.clone(),
            shape: entry.shape.clone(),
            what,
            range,
        }
        .into())
    };
    let elem = entry.dtype.size_bytes() as u64;
    match &slice {
        Slice::Whole => Ok(Some(entry)),
        Slice::Skip => Ok(None),
        Slice::Rows(range) => {
            let Some(&rows) = entry.shape.first() else {
                return out_of_range(&entry, &slice);
            };
            if range.start > range.end || range.end > rows {
                return out_of_range(&entry, &slice);
            }
            // The header checked that the shape fills the range exactly.
            let row = (entry.end - entry.start)
                .checked_div(rows as u64)
                .unwrap_or(0);
            entry.start += range.start as u64 * row;
            entry.end = entry.start + range.len() as u64 * row;
            entry.shape[0] = range.len();
            Ok(Some(entry))
        }
        Slice::Columns(range) => {
            let Some(&cols) = entry.shape.last() else {
                return out_of_range(&entry, &slice);
            };
            if range.start > range.end || range.end > cols {
                return out_of_range(&entry, &slice);
            }
            let last = entry.shape.len() - 1;
            // Every dimension but the last: the rows of the runs.
            let rows: u64 = entry.shape[..last].iter().map(|&d| d as u64).product();
            let run = range.len() as u64 * elem;
            let stride = cols as u64 * elem;
            entry.shape[last] = range.len();
            if rows == 0 || run == 0 {
                entry.end = entry.start;
                return Ok(Some(entry));
            }
            entry.start += range.start as u64 * elem;
            entry.end = entry.start + rows * run;
            // One run, or runs that touch, are one contiguous range.
            if rows > 1 && run < stride {
                entry.runs = Some(Runs { stride, len: run });
            }
            Ok(Some(entry))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn entry(shape: &[usize], dtype: DType, start: u64) -> Entry {
        let bytes = (shape.iter().product::<usize>() * dtype.size_bytes()) as u64;
        Entry {
            name: "t".into(),
            dtype,
            shape: shape.to_vec(),
            start,
            end: start + bytes,
            runs: None,
        }
    }

    #[test]
    fn patterns_match_as_globs() {
        assert!(matches("a.weight", "a.weight"));
        assert!(!matches("a.weight", "a.weights"));
        assert!(!matches("a.weight", "xa.weight"));
        assert!(matches("*", ""));
        assert!(matches("*.weight", "layers.0.q.weight"));
        assert!(!matches("*.weight", "layers.0.q.bias"));
        assert!(matches("layers.*.q.*", "layers.12.q.weight"));
        assert!(!matches("layers.*.q.*", "layers.12.k.weight"));
        assert!(matches("*q*q*", "qq"));
        assert!(!matches("*q*q*", "q"));
        assert!(matches("a*a", "aa"));
        assert!(!matches("a*a", "a"));
        assert!(matches("**", "x"));
    }

    #[test]
    fn a_split_divides_a_dimension_or_says_why_not() {
        let plan = |rank| {
            TensorParallel::new(rank, 3)
                .unwrap()
                .rows("r.*")
                .columns("c.*")
        };
        assert_eq!(plan(2).slice("r.w", &[9, 4]).unwrap(), Slice::Rows(6..9));
        assert_eq!(
            plan(0).slice("c.w", &[2, 5, 6]).unwrap(),
            Slice::Columns(0..2)
        );
        assert_eq!(plan(1).slice("n.w", &[7]).unwrap(), Slice::Whole);
        assert_eq!(plan(1).slice("r.s", &[]).unwrap(), Slice::Whole);
        let err = plan(1).slice("r.w", &[10, 4]).unwrap_err();
        assert!(
            matches!(
                err,
                crate::Error::Usage(UsageError::UnevenSplit {
                    ref tensor,
                    dimension: 0,
                    size: 10,
                    world: 3
                }) if tensor == "r.w"
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("r.w"), "{err}");
        // Allowed, the ranges cover the dimension and differ by at most one.
        let ranges: Vec<Slice> = (0..3)
            .map(|r| plan(r).uneven(true).slice("c.w", &[2, 10]).unwrap())
            .collect();
        assert_eq!(
            ranges,
            [
                Slice::Columns(0..3),
                Slice::Columns(3..6),
                Slice::Columns(6..10)
            ]
        );
        assert!(matches!(
            TensorParallel::new(3, 3).unwrap_err(),
            crate::Error::Usage(UsageError::NotARank { rank: 3, world: 3 })
        ));
        assert!(TensorParallel::new(0, 0).is_err());
    }

    #[test]
    fn rows_are_one_range_and_columns_are_runs() {
        let t = entry(&[4, 6], DType::F32, 100);
        let r = cut(t.clone(), Slice::Rows(1..3)).unwrap().unwrap();
        assert_eq!(
            (r.start, r.end, r.shape.clone(), r.runs),
            (124, 172, vec![2, 6], None)
        );
        let c = cut(t.clone(), Slice::Columns(2..5)).unwrap().unwrap();
        assert_eq!(
            (c.start, c.end, c.shape.clone()),
            (108, 108 + 48, vec![4, 3])
        );
        assert_eq!(
            c.runs,
            Some(Runs {
                stride: 24,
                len: 12
            })
        );
        assert_eq!(c.runs.unwrap().file_offset(c.start, 13), 108 + 24 + 1);
        // All the columns, or one row: contiguous.
        let all = cut(t.clone(), Slice::Columns(0..6)).unwrap().unwrap();
        assert_eq!((all.start, all.end, all.runs), (100, 196, None));
        let one = cut(entry(&[1, 6], DType::BF16, 0), Slice::Columns(1..4))
            .unwrap()
            .unwrap();
        assert_eq!((one.start, one.end, one.runs), (2, 8, None));
        // Empty slices read nothing.
        let none = cut(t.clone(), Slice::Columns(3..3)).unwrap().unwrap();
        assert_eq!(
            (none.start, none.end, none.shape),
            (none.start, none.start, vec![4, 0])
        );
        assert!(cut(t.clone(), Slice::Skip).unwrap().is_none());
        for bad in [
            Slice::Rows(2..5),
            Slice::Columns(5..7),
            #[allow(clippy::reversed_empty_ranges)]
            Slice::Rows(3..2),
        ] {
            let err = cut(t.clone(), bad.clone()).unwrap_err();
            let (what, range) = match bad {
                Slice::Rows(r) => ("rows", r),
                Slice::Columns(r) => ("columns", r),
                _ => unreachable!(),
            };
            assert!(
                matches!(err, crate::Error::Usage(UsageError::SliceOutOfRange { what: w, range: ref r, .. }) if w == what && *r == range),
                "{err:?}"
            );
        }
        assert!(cut(entry(&[], DType::F32, 0), Slice::Rows(0..1)).is_err());
        assert!(cut(entry(&[], DType::F32, 0), Slice::Columns(0..1)).is_err());
    }
}
