//! One variable of a local store, opened with zarrs, and the row TVs of its blocks: blocks
//! that are whole chunks of the layout kvcouple writes are decoded by [`crate::direct`] from the
//! chunk files ([`LocalFiles`]), any other layout (sharded, other codecs) by zarrs' codec
//! pipeline. A chunk file that is absent is an error here (Zarr would return its fill value).

use std::ops::Range;
use std::sync::Arc;

use zarrs::array::{Array, ArrayBytes, ArraySubset, CodecOptions};
use zarrs::filesystem::FilesystemStore;
use zarrs::storage::ReadableStorageTraits;

use kvcouple_core::rows::Dtype;

use crate::blocks::{
    check_blocks, consume, direct_block_tv, itemsize, per_block, BlockOutput, DirectChunk, KeyOf,
    Owned,
};
use crate::direct;
use crate::source::LocalFiles;
use crate::Problem;

type Store = Array<FilesystemStore>;

/// One variable of a local store, opened with zarrs.
pub struct LocalVariable {
    array: Store,
    storage: Arc<FilesystemStore>,
    files: LocalFiles,
    direct: Option<direct::Layout>,
}

impl LocalVariable {
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
            files: LocalFiles::new(root),
            direct,
        })
    }

    /// The chunk of `block` where it is exactly one chunk of a layout [`direct`] decodes with
    /// items of `itemsize` bytes, else None (zarrs reads it).
    fn direct_chunk(&self, block: &[Range<u64>], itemsize: usize) -> Option<DirectChunk<'_>> {
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
        let key = self.array.chunk_key(&indices).as_str().to_string();
        Some(DirectChunk {
            source: &self.files,
            key: key.into(),
            crc32c: layout.crc32c,
        })
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

/// The TVs of every row of every block: `blocks[i]` gives one range per axis of `p` (the last
/// axis, the vocabulary, whole). Blocks are decoded and consumed in parallel; the result holds
/// the blocks' rows one after another, in the order given. With `tolerance`, every row of `p`
/// and `q` is checked to be a distribution first
/// ([`kvcouple_core::row_check`]). `output` says what each row gives: its TV, its TV and
/// top-token delta, or (`DecodeOnly`) nothing computed or checked, every row 0: the decode
/// floor, measured on the same code path.
pub fn blocks_tv(
    p: &LocalVariable,
    q: &LocalVariable,
    blocks: &[Vec<Range<u64>>],
    kind: Dtype,
    tolerance: Option<f64>,
    output: BlockOutput,
) -> Result<Vec<f64>, Problem> {
    let vocab = check_blocks(p.shape(), q.shape(), blocks)?;
    // One block per task: the codecs inside a task run serially, the tasks fill the cores.
    // Checksums are verified whatever zarrs' global configuration says.
    let options = CodecOptions::default()
        .with_concurrent_target(1)
        .with_validate_checksums(true);
    let (pk, qk) = (|i: &[u64]| p.key_of(i), |i: &[u64]| q.key_of(i));
    let keys: (KeyOf, KeyOf) = (&pk, &qk);
    let size = itemsize(kind);
    per_block(blocks, |_, b| {
        if let (Some(pc), Some(qc)) = (p.direct_chunk(b, size), q.direct_chunk(b, size)) {
            return direct_block_tv((pc, qc), b, kind, vocab, tolerance, output);
        }
        let subset = ArraySubset::new_with_ranges(b);
        let rows = subset.num_elements_usize() / vocab;
        let want = rows * vocab * size;
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
        let (pr, qr) = (Owned::new(&pb, kind), Owned::new(&qb, kind));
        consume(
            keys,
            b,
            (pr.rows(), qr.rows()),
            rows,
            vocab,
            tolerance,
            output,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_store_is_unsupported_not_a_panic() {
        assert!(matches!(
            LocalVariable::open("/nonexistent/kvcouple/store.zarr", "p"),
            Err(Problem::Unsupported { .. })
        ));
    }
}
