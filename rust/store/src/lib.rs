//! kvcouple-store: the heavy half of reading a trace store, on the `zarrs` crate.
//!
//! Python's `kvcouple.store.reader.TraceStoreReader` decides *what* to read (it owns the store's
//! geometry and validation); this crate decodes the blocks it names — Zarr v2 or v3, sharded or
//! not, zstd/blosc/gzip/zlib or uncompressed — in parallel (rayon, in kvcouple's pool) and
//! consumes each block at once: decode `p` and `q`, recompute every row's TV, keep only the TVs.
//! Memory is a block pair per thread, whatever the store's size.
//!
//! A chunk file that is absent is an error here (Zarr would return its fill value), and so is
//! one that does not decode; both name the chunk key. An array zarrs cannot open (a codec it
//! lacks) is reported as unsupported so the caller can fall back to zarr-python.

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;
use zarrs::array::{Array, ArrayBytes, ArraySubset, CodecOptions};
use zarrs::filesystem::FilesystemStore;
use zarrs::storage::ReadableStorageTraits;

use kvcouple_core::parallel;
use kvcouple_core::rows::{Dtype, Rows};
use kvcouple_core::stats::recompute::row_tv;

/// Why a read failed, with the chunk key where there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("chunk {key} is missing")]
    Missing { key: String },
    #[error("chunk {key} cannot be decoded ({message})")]
    Decode { key: String, message: String },
    #[error("{message}")]
    Unsupported { message: String },
}

type Store = Array<FilesystemStore>;

/// One variable of a local store, opened with zarrs.
pub struct Variable {
    array: Store,
    storage: Arc<FilesystemStore>,
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
        Ok(Self { array, storage })
    }

    pub fn shape(&self) -> &[u64] {
        self.array.shape()
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
                    return Problem::Decode {
                        key: self.array.chunk_key(&idx).as_str().to_string(),
                        message: e.to_string(),
                    };
                }
            }
        }
        Problem::Decode {
            key: format!("{}", self.array.path()),
            message,
        }
    }
}

fn itemsize(kind: Dtype) -> usize {
    match kind {
        Dtype::F16 | Dtype::BF16 => 2,
        Dtype::F32 => 4,
        Dtype::F64 => 8,
    }
}

/// Row TVs of one decoded block pair (`rows x vocab`, raw bytes in `kind`).
fn block_tv(p: &[u8], q: &[u8], rows: usize, vocab: usize, kind: Dtype) -> Vec<f64> {
    // The decoded bytes are only byte-aligned: copy into typed vectors (a memcpy, small next to
    // decompression) rather than reinterpret.
    let run = |pr: Rows, qr: Rows| row_tv(pr, qr, rows, vocab).unwrap_or_default();
    match kind {
        Dtype::F16 | Dtype::BF16 => {
            let a: Vec<u16> = bytemuck::pod_collect_to_vec(p);
            let b: Vec<u16> = bytemuck::pod_collect_to_vec(q);
            if kind == Dtype::F16 {
                run(Rows::F16(&a), Rows::F16(&b))
            } else {
                run(Rows::BF16(&a), Rows::BF16(&b))
            }
        }
        Dtype::F32 => {
            let a: Vec<f32> = bytemuck::pod_collect_to_vec(p);
            let b: Vec<f32> = bytemuck::pod_collect_to_vec(q);
            run(Rows::F32(&a), Rows::F32(&b))
        }
        Dtype::F64 => {
            let a: Vec<f64> = bytemuck::pod_collect_to_vec(p);
            let b: Vec<f64> = bytemuck::pod_collect_to_vec(q);
            run(Rows::F64(&a), Rows::F64(&b))
        }
    }
}

/// The TVs of every row of every block: `blocks[i]` gives one range per axis of `p` (the last
/// axis, the vocabulary, whole). Blocks are decoded and consumed in parallel; the result holds
/// the blocks' rows one after another, in the order given. With `decode_only` nothing is
/// computed (every row is 0): the decode floor, measured on the same code path.
pub fn blocks_tv(
    p: &Variable,
    q: &Variable,
    blocks: &[Vec<Range<u64>>],
    kind: Dtype,
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
    let options = CodecOptions::default().with_concurrent_target(1);
    let per_block: Vec<Result<Vec<f64>, Problem>> = parallel::install(|| {
        blocks
            .par_iter()
            .map(|b| {
                let subset = ArraySubset::new_with_ranges(b);
                let rows = subset.num_elements_usize() / vocab;
                let pb = p.read(&subset, &options)?;
                let qb = q.read(&subset, &options)?;
                let want = rows * vocab * itemsize(kind);
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
                Ok(block_tv(&pb, &qb, rows, vocab, kind))
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
    fn block_tv_of_halves() {
        // 0x3800 = 0.5: TV((.5, .5, 0, 0), (0, 0, .5, .5)) = 1 and TV(p, p) = 0.
        let p: Vec<u8> = [0x3800u16, 0x3800, 0, 0, 0x3800, 0x3800, 0, 0]
            .iter()
            .flat_map(|h| h.to_le_bytes())
            .collect();
        let q: Vec<u8> = [0u16, 0, 0x3800, 0x3800, 0x3800, 0x3800, 0, 0]
            .iter()
            .flat_map(|h| h.to_le_bytes())
            .collect();
        assert_eq!(block_tv(&p, &q, 2, 4, Dtype::F16), vec![1.0, 0.0]);
    }
}
