//! kvcouple-store: the heavy half of reading a trace store, on the `zarrs` crate.
//!
//! Python's `kvcouple.store.reader.TraceStoreReader` decides *what* to read (it owns the store's
//! geometry and validation); this crate decodes the blocks it names — Zarr v2 or v3, sharded or
//! not, zstd/blosc/gzip/zlib or uncompressed — in parallel (rayon, in kvcouple's pool) and
//! consumes each block at once: decode `p` and `q`, recompute every row's TV, keep only the TVs.
//! Memory is a block pair per thread, whatever the store's size.
//!
//! A chunk file that is absent is an error here (Zarr would return its fill value), and so is
//! one that does not decode or fails its checksum (crc32c, or Zstd's frame checksum, always
//! verified); all name the chunk key. With a tolerance, every decoded row must be a
//! distribution (all NaN, or finite, >= 0 and summing to 1): the first that is not is named by
//! its chunk and index. An array zarrs cannot open (a codec it lacks) is reported as
//! unsupported so the caller can fall back to zarr-python.
//!
//! Blocks that are whole chunks of the layout kvcouple writes (zstd, crc32c) skip zarrs' codec
//! pipeline: [`direct`] decodes them into reused buffers that the kernels read in place.

pub mod chunks;
mod direct;
pub mod remote;

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use rayon::prelude::*;
use zarrs::array::{Array, ArrayBytes, ArraySubset, CodecOptions};
use zarrs::filesystem::FilesystemStore;
use zarrs::storage::ReadableStorageTraits;

use kvcouple_core::parallel;
use kvcouple_core::rows::{Dtype, Rows};
use kvcouple_core::stats::recompute::{row_tv, row_tv_checked, RowViolation};

/// Why a read failed, with the chunk key where there is one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Problem {
    #[error("chunk {key} is missing")]
    Missing { key: String },
    #[error("chunk {key} cannot be decoded ({message})")]
    Decode { key: String, message: String },
    /// The chunk's bytes do not match their stored checksum.
    #[error("chunk {key} fails its checksum ({message})")]
    Checksum { key: String, message: String },
    /// A decoded row is not a distribution: element `index` (one entry per axis; for a bad
    /// sum the last entry is -1) holds `value` (`what` is "entry" or "sum").
    #[error("chunk {key} holds {value} at {index:?} ({what})")]
    Value {
        key: String,
        index: Vec<i64>,
        value: f64,
        what: &'static str,
    },
    #[error("{message}")]
    Unsupported { message: String },
}

type Store = Array<FilesystemStore>;

/// One variable of a local store, opened with zarrs.
pub struct Variable {
    array: Store,
    storage: Arc<FilesystemStore>,
    direct: Option<direct::Layout>,
}

impl Variable {
    /// Open `name` (an array path inside the store, e.g. `"p"`) of the store at `root`.
    pub fn open(root: &str, name: &str) -> Result<Self, Problem> {
        let storage = Arc::new(
            FilesystemStore::new(root).map_err(|e| Problem::Unsupported {
                message: format!("cannot open {root} with zarrs: {e}"),
            })?,
        );
        let array = Array::open(storage.clone(), &format!("/{name}")).map_err(|e| {
            Problem::Unsupported {
                message: format!("zarrs cannot open variable {name}: {e}"),
            }
        })?;
        let direct = direct::layout(array.metadata());
        Ok(Self {
            array,
            storage,
            direct,
        })
    }

    /// The chunk file and key of `block` where it is exactly one chunk of a layout
    /// [`direct`] decodes with items of `itemsize` bytes, else None (zarrs reads it).
    fn direct_chunk(&self, block: &[Range<u64>], itemsize: usize) -> Option<(PathBuf, String)> {
        let layout = self.direct.as_ref()?;
        if layout.itemsize != itemsize || layout.chunk.len() != block.len() {
            return None;
        }
        let mut indices = Vec::with_capacity(block.len());
        for (r, &c) in block.iter().zip(&layout.chunk) {
            if c == 0 || r.start % c != 0 || r.end - r.start != c {
                return None;
            }
            indices.push(r.start / c);
        }
        let key = self.array.chunk_key(&indices);
        Some((self.storage.key_to_fspath(&key), key.as_str().to_string()))
    }

    pub fn shape(&self) -> &[u64] {
        self.array.shape()
    }

    /// Whether the blocks [`direct`] reads carry a crc32c suffix.
    fn direct_crc32c(&self) -> bool {
        self.direct.as_ref().is_some_and(|d| d.crc32c)
    }

    /// Every stored object (chunk or shard) a subset touches must exist.
    fn check_present(&self, subset: &ArraySubset) -> Result<(), Problem> {
        let chunks = self
            .array
            .chunks_in_array_subset(subset)
            .ok()
            .flatten()
            .ok_or_else(|| Problem::Unsupported {
                message: format!("subset {subset} is outside the array"),
            })?;
        for idx in &chunks.indices() {
            let key = self.array.chunk_key(&idx);
            match self.storage.size_key(&key) {
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Err(Problem::Missing {
                        key: key.as_str().to_string(),
                    })
                }
                Err(e) => {
                    return Err(Problem::Decode {
                        key: key.as_str().to_string(),
                        message: e.to_string(),
                    })
                }
            }
        }
        Ok(())
    }

    /// The raw bytes (native endianness, C order) of a subset, every chunk checked.
    pub fn read(&self, subset: &ArraySubset, options: &CodecOptions) -> Result<Vec<u8>, Problem> {
        self.check_present(subset)?;
        match self
            .array
            .retrieve_array_subset_opt::<ArrayBytes<'static>>(subset, options)
        {
            Ok(bytes) => {
                bytes
                    .into_fixed()
                    .map(|b| b.into_owned())
                    .map_err(|e| Problem::Unsupported {
                        message: e.to_string(),
                    })
            }
            Err(e) => Err(self.locate(subset, options, e.to_string())),
        }
    }

    /// Name the chunk that fails to decode (the subset's error may not say which).
    fn locate(&self, subset: &ArraySubset, options: &CodecOptions, message: String) -> Problem {
        if let Ok(Some(chunks)) = self.array.chunks_in_array_subset(subset) {
            for idx in &chunks.indices() {
                if let Err(e) = self
                    .array
                    .retrieve_chunk_opt::<ArrayBytes<'static>>(&idx, options)
                {
                    let key = self.array.chunk_key(&idx).as_str().to_string();
                    let message = e.to_string();
                    // zarrs' crc32c codec and zstd's frame check both say "checksum".
                    if message.to_lowercase().contains("checksum") {
                        return Problem::Checksum { key, message };
                    }
                    return Problem::Decode { key, message };
                }
            }
        }
        Problem::Decode {
            key: format!("{}", self.array.path()),
            message,
        }
    }

    /// The key of the stored object holding element `index`.
    fn key_of(&self, index: &[u64]) -> String {
        let one: Vec<Range<u64>> = index.iter().map(|&i| i..i + 1).collect();
        self.array
            .chunks_in_array_subset(&ArraySubset::new_with_ranges(&one))
            .ok()
            .flatten()
            .and_then(|c| (&c.indices()).into_iter().next())
            .map(|idx| self.array.chunk_key(&idx).as_str().to_string())
            .unwrap_or_else(|| self.array.path().to_string())
    }
}

/// Rows of a decoded block as `Rows` (the decoded bytes are only byte-aligned: a copy).
enum Owned {
    Half(Vec<u16>, bool),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Owned {
    fn new(bytes: &[u8], kind: Dtype) -> Self {
        match kind {
            Dtype::F16 | Dtype::BF16 => {
                Owned::Half(bytemuck::pod_collect_to_vec(bytes), kind == Dtype::F16)
            }
            Dtype::F32 => Owned::F32(bytemuck::pod_collect_to_vec(bytes)),
            Dtype::F64 => Owned::F64(bytemuck::pod_collect_to_vec(bytes)),
        }
    }

    fn rows(&self) -> Rows<'_> {
        match self {
            Owned::Half(v, true) => Rows::F16(v),
            Owned::Half(v, false) => Rows::BF16(v),
            Owned::F32(v) => Rows::F32(v),
            Owned::F64(v) => Rows::F64(v),
        }
    }
}

/// The key of the stored object holding an element (a variable's, or a fetched chunk's).
type KeyOf<'a> = &'a (dyn Fn(&[u64]) -> String + Sync);

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

fn itemsize(kind: Dtype) -> usize {
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

/// What one decoded block pair gives: its row TVs, checked first with `tolerance`.
fn consume(
    (p, q): (KeyOf, KeyOf),
    block: &[Range<u64>],
    (pr, qr): (Rows, Rows),
    rows: usize,
    vocab: usize,
    tolerance: Option<f64>,
) -> Result<Vec<f64>, Problem> {
    let Some(tol) = tolerance else {
        return Ok(row_tv(pr, qr, rows, vocab).unwrap_or_default());
    };
    // Checked and computed in one pass over the rows.
    match row_tv_checked(pr, qr, rows, vocab, tol) {
        Ok(Ok(tv)) => Ok(tv),
        Ok(Err((side, v))) => Err(value_problem(if side == 0 { p } else { q }, block, v)),
        Err(e) => Err(Problem::Unsupported {
            message: e.to_string(),
        }),
    }
}

/// The TVs of every row of every block: `blocks[i]` gives one range per axis of `p` (the last
/// axis, the vocabulary, whole). Blocks are decoded and consumed in parallel; the result holds
/// the blocks' rows one after another, in the order given. With `tolerance`, every row of `p`
/// and `q` is checked to be a distribution first ([`row_check`]). With `decode_only` nothing
/// is computed or checked (every row is 0): the decode floor, measured on the same code path.
pub fn blocks_tv(
    p: &Variable,
    q: &Variable,
    blocks: &[Vec<Range<u64>>],
    kind: Dtype,
    tolerance: Option<f64>,
    decode_only: bool,
) -> Result<Vec<f64>, Problem> {
    if p.shape() != q.shape() {
        return Err(Problem::Unsupported {
            message: format!("p has shape {:?} and q {:?}", p.shape(), q.shape()),
        });
    }
    let ndim = p.shape().len();
    let vocab = *p.shape().last().unwrap_or(&0) as usize;
    if vocab == 0 {
        return Err(Problem::Unsupported {
            message: "empty vocabulary axis".into(),
        });
    }
    for b in blocks {
        let whole = b
            .last()
            .is_some_and(|r| r.start == 0 && r.end == vocab as u64);
        let inside = b
            .iter()
            .zip(p.shape())
            .all(|(r, &n)| r.start < r.end && r.end <= n);
        if b.len() != ndim || !whole || !inside {
            return Err(Problem::Unsupported {
                message: format!(
                    "block {b:?} is not a set of whole rows of shape {:?}",
                    p.shape()
                ),
            });
        }
    }
    // One block per task: the codecs inside a task run serially, the tasks fill the cores.
    // Checksums are verified whatever zarrs' global configuration says.
    let options = CodecOptions::default()
        .with_concurrent_target(1)
        .with_validate_checksums(true);
    let (pk, qk) = (|i: &[u64]| p.key_of(i), |i: &[u64]| q.key_of(i));
    let keys: (KeyOf, KeyOf) = (&pk, &qk);
    let per_block: Vec<Result<Vec<f64>, Problem>> = parallel::install(|| {
        blocks
            .par_iter()
            .map(|b| {
                let subset = ArraySubset::new_with_ranges(b);
                let rows = subset.num_elements_usize() / vocab;
                let want = rows * vocab * itemsize(kind);
                let both = (
                    p.direct_chunk(b, itemsize(kind)),
                    q.direct_chunk(b, itemsize(kind)),
                );
                if let (Some((pf, pk)), Some((qf, qk))) = both {
                    let (mut pd, mut qd) = (direct::take(), direct::take());
                    let out = pd
                        .decode(&pf, &pk, want, p.direct_crc32c())
                        .and_then(|()| qd.decode(&qf, &qk, want, q.direct_crc32c()))
                        .and_then(|()| {
                            if decode_only {
                                return Ok(vec![0.0; rows]);
                            }
                            let n = rows * vocab;
                            let pair =
                                (rows_of(&pd.decoded, kind, n), rows_of(&qd.decoded, kind, n));
                            consume(keys, b, pair, rows, vocab, tolerance)
                        });
                    direct::give(pd);
                    direct::give(qd);
                    return out;
                }
                let pb = p.read(&subset, &options)?;
                let qb = q.read(&subset, &options)?;
                if pb.len() != want || qb.len() != want {
                    return Err(Problem::Unsupported {
                        message: format!(
                            "decoded {} and {} bytes, expected {want} ({kind:?} rows)",
                            pb.len(),
                            qb.len()
                        ),
                    });
                }
                if decode_only {
                    return Ok(vec![0.0; rows]);
                }
                let (pr, qr) = (Owned::new(&pb, kind), Owned::new(&qb, kind));
                consume(keys, b, (pr.rows(), qr.rows()), rows, vocab, tolerance)
            })
            .collect()
    });
    let mut out = Vec::new();
    for r in per_block {
        out.extend(r?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_store_is_unsupported_not_a_panic() {
        assert!(matches!(
            Variable::open("/nonexistent/kvcouple/store.zarr", "p"),
            Err(Problem::Unsupported { .. })
        ));
    }

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
