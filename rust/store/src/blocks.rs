//! Row TVs of blocks of `p` and `q`, wherever their chunks are stored: the blocks checked to be
//! whole rows, decoded in parallel (one block per task, in kvcouple's pool) and consumed at
//! once (every row checked to be a distribution first, with a tolerance). A block that is one
//! chunk of the layout kvcouple writes on each side is decoded by [`crate::direct`] from a
//! [`ChunkSource`]; the local store's other blocks come decoded from zarrs.

use std::borrow::Cow;
use std::ops::Range;

use rayon::prelude::*;

use kvcouple_core::parallel;
use kvcouple_core::row_check::RowViolation;
use kvcouple_core::row_top::row_top_delta;
use kvcouple_core::row_tv::{row_tv, row_tv_checked};
use kvcouple_core::rows::{Dtype, Rows};

use crate::direct;
use crate::source::ChunkSource;
use crate::Problem;

/// The key of the stored object holding an element (a variable's, or a block's one chunk's).
pub(crate) type KeyOf<'a> = &'a (dyn Fn(&[u64]) -> String + Sync);

/// Row `violation` of a decoded block (`block`: its range per axis) as a problem naming the
/// chunk and the element (for a bad sum, the row; the last index is then -1).
fn value_problem(key_of: KeyOf, block: &[Range<u64>], violation: RowViolation) -> Problem {
    let (row, col, value, what) = match violation {
        RowViolation::Entry { row, col, value } => (row, Some(col), value, "entry"),
        RowViolation::Sum { row, sum } => (row, None, sum, "sum"),
    };
    // Unravel the row over the block's leading axes (C order), then offset by the block.
    let last = block.len() - 1;
    let mut index = vec![0u64; block.len()];
    let mut rest = row as u64;
    for (ax, r) in block[..last].iter().enumerate().rev() {
        let len = r.end - r.start;
        index[ax] = r.start + rest % len;
        rest /= len;
    }
    index[last] = col.unwrap_or(0) as u64;
    let key = key_of(&index);
    let mut out: Vec<i64> = index.iter().map(|&i| i as i64).collect();
    if col.is_none() {
        out[last] = -1;
    }
    Problem::Value {
        key,
        index: out,
        value,
        what,
    }
}

pub(crate) fn itemsize(kind: Dtype) -> usize {
    match kind {
        Dtype::F16 | Dtype::BF16 => 2,
        Dtype::F32 => 4,
        Dtype::F64 => 8,
    }
}

/// `n` values of `kind` at the start of an aligned decoded buffer.
fn rows_of(words: &[u64], kind: Dtype, n: usize) -> Rows<'_> {
    match kind {
        Dtype::F16 => Rows::F16(&bytemuck::cast_slice(words)[..n]),
        Dtype::BF16 => Rows::BF16(&bytemuck::cast_slice(words)[..n]),
        Dtype::F32 => Rows::F32(&bytemuck::cast_slice(words)[..n]),
        Dtype::F64 => Rows::F64(&bytemuck::cast_slice(words)[..n]),
    }
}

/// What the engine gives for each row of a block pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOutput {
    /// Nothing computed (the decode floor): one zero per row.
    DecodeOnly,
    /// The row's TV.
    Tv,
    /// The row's TV and the scoreboard's `q(a) - p(a)` (`a = argmax p`), two values per row:
    /// full records are then not read a second time for the scoreboard.
    TvTopDelta,
}

impl BlockOutput {
    /// From the bindings' flags (`decode_only` wins).
    pub fn from_flags(decode_only: bool, top_delta: bool) -> Self {
        match (decode_only, top_delta) {
            (true, _) => BlockOutput::DecodeOnly,
            (false, false) => BlockOutput::Tv,
            (false, true) => BlockOutput::TvTopDelta,
        }
    }

    /// Values per row.
    pub fn width(self) -> usize {
        if self == BlockOutput::TvTopDelta {
            2
        } else {
            1
        }
    }
}

/// What one decoded block pair gives (`output`): its row TVs, checked first with `tolerance`,
/// and where asked each row's top-token delta after its TV.
pub(crate) fn consume(
    (p, q): (KeyOf, KeyOf),
    block: &[Range<u64>],
    (pr, qr): (Rows, Rows),
    rows: usize,
    vocab: usize,
    tolerance: Option<f64>,
    output: BlockOutput,
) -> Result<Vec<f64>, Problem> {
    let unsupported = |e: kvcouple_core::KvError| Problem::Unsupported {
        message: e.to_string(),
    };
    if output == BlockOutput::DecodeOnly {
        return Ok(vec![0.0; rows]);
    }
    if let Some(tol) = tolerance {
        // Checked and computed in one pass over the rows; each row's top-token delta, where
        // asked, made while the row is still in cache.
        let with_top = output == BlockOutput::TvTopDelta;
        return match row_tv_checked(pr, qr, rows, vocab, tol, with_top) {
            Ok(Ok(values)) => Ok(values),
            Ok(Err((side, v))) => Err(value_problem(if side == 0 { p } else { q }, block, v)),
            Err(e) => Err(unsupported(e)),
        };
    }
    let tv = row_tv(pr, qr, rows, vocab).unwrap_or_default();
    if output == BlockOutput::Tv {
        return Ok(tv);
    }
    let delta = row_top_delta(pr, qr, rows, vocab).map_err(unsupported)?;
    Ok(tv.iter().zip(&delta).flat_map(|(&t, &d)| [t, d]).collect())
}

/// The vocabulary, where `p` and `q` have one shape and every block is a set of whole rows
/// inside it (one range per axis, the last the whole vocabulary).
pub(crate) fn check_blocks(
    p_shape: &[u64],
    q_shape: &[u64],
    blocks: &[Vec<Range<u64>>],
) -> Result<usize, Problem> {
    let unsupported = |message: String| Problem::Unsupported { message };
    if p_shape != q_shape {
        return Err(unsupported(format!(
            "p has shape {p_shape:?} and q {q_shape:?}"
        )));
    }
    let vocab = *p_shape.last().unwrap_or(&0);
    if vocab == 0 {
        return Err(unsupported("empty vocabulary axis".into()));
    }
    for b in blocks {
        let whole = b.last().is_some_and(|r| r.start == 0 && r.end == vocab);
        let inside = b
            .iter()
            .zip(p_shape)
            .all(|(r, &n)| r.start < r.end && r.end <= n);
        if b.len() != p_shape.len() || !whole || !inside {
            return Err(unsupported(format!(
                "block {b:?} is not a set of whole rows of shape {p_shape:?}"
            )));
        }
    }
    Ok(vocab as usize)
}

/// One chunk object the direct path decodes: where it is, its key, whether a crc32c follows.
pub(crate) struct DirectChunk<'a> {
    pub source: &'a dyn ChunkSource,
    pub key: Cow<'a, str>,
    pub crc32c: bool,
}

/// The row TVs of a block that is one chunk of `p` and one of `q`, both decoded by the direct
/// path into reused buffers that the kernels read in place.
pub(crate) fn direct_block_tv(
    (p, q): (DirectChunk, DirectChunk),
    block: &[Range<u64>],
    kind: Dtype,
    vocab: usize,
    tolerance: Option<f64>,
    output: BlockOutput,
) -> Result<Vec<f64>, Problem> {
    let n: usize = block.iter().map(|r| (r.end - r.start) as usize).product();
    let rows = n / vocab;
    let want = n * itemsize(kind);
    let (mut pd, mut qd) = (direct::take(), direct::take());
    let out = pd
        .decode(p.source, &p.key, want, p.crc32c)
        .and_then(|()| qd.decode(q.source, &q.key, want, q.crc32c))
        .and_then(|()| {
            // The block is one chunk: every element's key is that chunk's.
            let (pk, qk) = (|_: &[u64]| p.key.to_string(), |_: &[u64]| q.key.to_string());
            let keys: (KeyOf, KeyOf) = (&pk, &qk);
            let pair = (rows_of(&pd.decoded, kind, n), rows_of(&qd.decoded, kind, n));
            consume(keys, block, pair, rows, vocab, tolerance, output)
        });
    direct::give(pd);
    direct::give(qd);
    out
}

/// `block_tv(i, block)` of every block, in parallel (one block per task: the codecs inside a
/// task run serially, the tasks fill the cores); the blocks' rows one after another, in the
/// order given, or the first problem in that order.
pub(crate) fn per_block(
    blocks: &[Vec<Range<u64>>],
    block_tv: impl Fn(usize, &[Range<u64>]) -> Result<Vec<f64>, Problem> + Sync,
) -> Result<Vec<f64>, Problem> {
    let per_block: Vec<Result<Vec<f64>, Problem>> = parallel::install(|| {
        blocks
            .par_iter()
            .enumerate()
            .map(|(i, b)| block_tv(i, b))
            .collect()
    });
    let mut out = Vec::new();
    for r in per_block {
        out.extend(r?);
    }
    Ok(out)
}

/// Rows of a block decoded by zarrs as `Rows` (the decoded bytes are only byte-aligned: a copy).
pub(crate) enum Owned {
    Half(Vec<u16>, bool),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Owned {
    pub fn new(bytes: &[u8], kind: Dtype) -> Self {
        match kind {
            Dtype::F16 | Dtype::BF16 => {
                Owned::Half(bytemuck::pod_collect_to_vec(bytes), kind == Dtype::F16)
            }
            Dtype::F32 => Owned::F32(bytemuck::pod_collect_to_vec(bytes)),
            Dtype::F64 => Owned::F64(bytemuck::pod_collect_to_vec(bytes)),
        }
    }

    pub fn rows(&self) -> Rows<'_> {
        match self {
            Owned::Half(v, true) => Rows::F16(v),
            Owned::Half(v, false) => Rows::BF16(v),
            Owned::F32(v) => Rows::F32(v),
            Owned::F64(v) => Rows::F64(v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tv_of_half_rows() {
        // 0x3800 = 0.5: TV((.5, .5, 0, 0), (0, 0, .5, .5)) = 1 and TV(p, p) = 0.
        let p: Vec<u8> = [0x3800u16, 0x3800, 0, 0, 0x3800, 0x3800, 0, 0]
            .iter()
            .flat_map(|h| h.to_le_bytes())
            .collect();
        let q: Vec<u8> = [0u16, 0, 0x3800, 0x3800, 0x3800, 0x3800, 0, 0]
            .iter()
            .flat_map(|h| h.to_le_bytes())
            .collect();
        let (p, q) = (Owned::new(&p, Dtype::F16), Owned::new(&q, Dtype::F16));
        assert_eq!(row_tv(p.rows(), q.rows(), 2, 4).unwrap(), vec![1.0, 0.0]);
    }
}
