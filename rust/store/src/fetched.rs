//! Blocks of a store on object storage (`s3://`, `gs://`, ...): the caller fetches the chunk
//! objects (many requests in flight, with its own credentials and endpoint) and hands their
//! bytes here ([`FetchedObjects`]), where they are checked, decoded and consumed like a local
//! store's blocks ([`crate::local::blocks_tv`], the same code): crc32c verified, a missing
//! object named, every row checked to be a distribution before its TV counts.
//!
//! Only the layout kvcouple writes is read this way (one block is one whole chunk, encoded
//! `bytes` -> `zstd` (-> `crc32c`), see [`crate::direct`]); anything else is
//! [`Problem::Unsupported`], so the caller reads it with zarr-python.

use std::ops::Range;

use serde_json::Value;
use zarrs::metadata::ArrayMetadata;

use kvcouple_core::rows::Dtype;

use crate::blocks::{check_blocks, direct_block_tv, itemsize, per_block, BlockOutput, DirectChunk};
use crate::direct::{self, Layout};
use crate::source::FetchedObjects;
use crate::Problem;

/// One variable on object storage: its metadata document (`zarr.json` or `.zarray`), parsed.
pub struct FetchedVariable {
    shape: Vec<u64>,
    layout: Layout,
}

impl FetchedVariable {
    /// Parse `metadata` (the array's metadata document as stored); unsupported unless the
    /// direct layout reads it.
    pub fn new(name: &str, metadata: &str) -> Result<Self, Problem> {
        let unsupported = |why: String| Problem::Unsupported {
            message: format!("variable {name} on object storage: {why}"),
        };
        let meta: ArrayMetadata =
            serde_json::from_str(metadata).map_err(|e| unsupported(e.to_string()))?;
        let json: Value = serde_json::from_str(metadata).map_err(|e| unsupported(e.to_string()))?;
        let shape: Option<Vec<u64>> = json
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect());
        let shape = shape.ok_or_else(|| unsupported("no shape".into()))?;
        let layout = direct::layout(&meta).ok_or_else(|| {
            unsupported("not one zstd(+crc32c) chunk per block (sharded, or other codecs)".into())
        })?;
        if layout.chunk.len() != shape.len() {
            return Err(unsupported("chunk shape and shape disagree".into()));
        }
        Ok(Self { shape, layout })
    }

    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Whether `block` is exactly one whole chunk.
    fn is_chunk(&self, block: &[Range<u64>]) -> bool {
        block.len() == self.layout.chunk.len()
            && block
                .iter()
                .zip(&self.layout.chunk)
                .all(|(r, &c)| c > 0 && r.start % c == 0 && r.end - r.start == c)
    }
}

/// The row TVs of every block (each exactly one chunk; the last axis the whole vocabulary)
/// from the fetched chunk objects of `p` and `q` (`p_keys[i]`, `q_keys[i]` name block `i`'s
/// objects in `objects`), as [`crate::local::blocks_tv`] gives them for a local store.
pub fn chunks_tv(
    (p, q): (&FetchedVariable, &FetchedVariable),
    blocks: &[Vec<Range<u64>>],
    (p_keys, q_keys): (&[&str], &[&str]),
    objects: &FetchedObjects,
    kind: Dtype,
    tolerance: Option<f64>,
    output: BlockOutput,
) -> Result<Vec<f64>, Problem> {
    let unsupported = |message: String| Problem::Unsupported { message };
    let vocab = check_blocks(&p.shape, &q.shape, blocks)?;
    if p.layout.itemsize != itemsize(kind) || q.layout.itemsize != itemsize(kind) {
        return Err(unsupported(format!("stored items are not {kind:?}")));
    }
    if p_keys.len() != blocks.len() || q_keys.len() != blocks.len() {
        return Err(unsupported(
            "one fetched chunk per block and variable".into(),
        ));
    }
    if let Some(b) = blocks.iter().find(|b| !p.is_chunk(b) || !q.is_chunk(b)) {
        return Err(unsupported(format!(
            "block {b:?} is not one chunk of whole rows of shape {:?}",
            p.shape
        )));
    }
    per_block(blocks, |i, b| {
        let pc = DirectChunk {
            source: objects,
            key: p_keys[i].into(),
            crc32c: p.layout.crc32c,
        };
        let qc = DirectChunk {
            source: objects,
            key: q_keys[i].into(),
            crc32c: q.layout.crc32c,
        };
        direct_block_tv((pc, qc), b, kind, vocab, tolerance, output)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const META: &str = r#"{"zarr_format": 3, "node_type": "array", "shape": [2, 4],
        "data_type": "float16", "chunk_grid": {"name": "regular",
        "configuration": {"chunk_shape": [1, 4]}}, "chunk_key_encoding": {"name": "default"},
        "fill_value": 0.0, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "zstd", "configuration": {"level": 1, "checksum": false}}, {"name": "crc32c"}]}"#;

    fn chunk(halves: &[u16]) -> Vec<u8> {
        let raw: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();
        let mut file = zstd::bulk::compress(&raw, 1).unwrap();
        file.extend_from_slice(&crc32c::crc32c(&file).to_le_bytes());
        file
    }

    #[test]
    fn fetched_chunks_give_tvs_and_name_damage() {
        let v = FetchedVariable::new("p", META).unwrap();
        // 0x3800 = 0.5: TV((.5, .5, 0, 0), (0, 0, .5, .5)) = 1 and TV(p, p) = 0.
        let (p0, p1) = (
            chunk(&[0x3800, 0x3800, 0, 0]),
            chunk(&[0, 0, 0x3800, 0x3800]),
        );
        let (q0, q1) = (
            chunk(&[0, 0, 0x3800, 0x3800]),
            chunk(&[0, 0, 0x3800, 0x3800]),
        );
        let blocks = vec![vec![0..1, 0..4], vec![1..2, 0..4]];
        let (ps, qs): ([&str; 2], [&str; 2]) = (["p/0.0", "p/1.0"], ["q/0.0", "q/1.0"]);
        let objects = |p1: Option<&[u8]>, q1: &[u8]| -> Vec<(&str, Option<Vec<u8>>)> {
            vec![
                ("p/0.0", Some(p0.clone())),
                ("p/1.0", p1.map(<[u8]>::to_vec)),
                ("q/0.0", Some(q0.clone())),
                ("q/1.0", Some(q1.to_vec())),
            ]
        };
        let out =
            |stored: &[(&str, Option<Vec<u8>>)], tolerance, blocks: &[Vec<Range<u64>>], output| {
                let fetched = FetchedObjects::new(stored.iter().map(|(k, b)| (*k, b.as_deref())));
                let n = blocks.len();
                let keys = (&ps[..n], &qs[..n]);
                chunks_tv(
                    (&v, &v),
                    blocks,
                    keys,
                    &fetched,
                    Dtype::F16,
                    tolerance,
                    output,
                )
            };
        let tvs = |stored: &[(&str, Option<Vec<u8>>)], tolerance, blocks: &[Vec<Range<u64>>]| {
            out(stored, tolerance, blocks, BlockOutput::Tv)
        };
        let tv = tvs(&objects(Some(&p1), &q1), Some(1e-3), &blocks);
        assert_eq!(tv.unwrap(), vec![1.0, 0.0]);
        // With the top-token deltas: P's first top token is 0 (q = 0 there), then q = p.
        let both = out(
            &objects(Some(&p1), &q1),
            Some(1e-3),
            &blocks,
            BlockOutput::TvTopDelta,
        );
        assert_eq!(both.unwrap(), vec![1.0, -0.5, 0.0, 0.0]);
        // A missing object and a flipped byte are named by key.
        let err = tvs(&objects(None, &q1), None, &blocks);
        assert!(matches!(err, Err(Problem::Missing { ref key }) if key == "p/1.0"));
        let mut bad = q1.to_vec();
        bad[3] ^= 1;
        let err = tvs(&objects(Some(&p1), &bad), None, &blocks);
        assert!(matches!(err, Err(Problem::Checksum { ref key, .. }) if key == "q/1.0"));
        // A block that is not one chunk is not read here.
        let two = vec![vec![0..2, 0..4]];
        let err = tvs(&objects(Some(&p1), &q1), None, &two);
        assert!(matches!(err, Err(Problem::Unsupported { .. })));
    }
}
