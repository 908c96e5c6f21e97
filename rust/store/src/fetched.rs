//! Blocks of a store on object storage (`s3://`, `gs://`, ...): the caller fetches the chunk
//! objects (many requests in flight, with its own credentials and endpoint) and hands their
//! bytes here, where they are checked and decoded in parallel and consumed like local blocks
//! ([`crate::blocks_tv`]): crc32c verified, a missing object named, every row checked to be
//! a distribution before its TV counts.
//!
//! Only the layout kvcouple writes is read this way (one block is one whole chunk, encoded
//! `bytes` -> `zstd` (-> `crc32c`), see [`crate::direct`]); anything else is
//! [`Problem::Unsupported`], so the caller reads it with zarr-python.

use std::ops::Range;

use rayon::prelude::*;
use serde_json::Value;
use zarrs::metadata::ArrayMetadata;

use kvcouple_core::parallel;
use kvcouple_core::rows::Dtype;

use crate::direct::{self, Layout};
use crate::{consume, itemsize, rows_of, KeyOf, Problem};

/// One variable on object storage: its metadata document (`zarr.json` or `.zarray`), parsed.
pub struct RemoteVariable {
    shape: Vec<u64>,
    layout: Layout,
}

impl RemoteVariable {
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

/// A fetched chunk object: its key, and its bytes (None where the object does not exist).
pub struct Fetched<'a> {
    pub key: &'a str,
    pub bytes: Option<&'a [u8]>,
}

/// The row TVs of every block (each exactly one chunk; the last axis the whole vocabulary)
/// from the fetched chunk objects of `p` and `q` (`p_chunks[i]`, `q_chunks[i]` hold block
/// `i`), as [`crate::blocks_tv`] gives them for a local store.
pub fn chunks_tv(
    (p, q): (&RemoteVariable, &RemoteVariable),
    blocks: &[Vec<Range<u64>>],
    (p_chunks, q_chunks): (&[Fetched], &[Fetched]),
    kind: Dtype,
    tolerance: Option<f64>,
    decode_only: bool,
) -> Result<Vec<f64>, Problem> {
    let unsupported = |message: String| Problem::Unsupported { message };
    if p.shape != q.shape {
        return Err(unsupported(format!(
            "p has shape {:?} and q {:?}",
            p.shape, q.shape
        )));
    }
    if p.layout.itemsize != itemsize(kind) || q.layout.itemsize != itemsize(kind) {
        return Err(unsupported(format!("stored items are not {kind:?}")));
    }
    if p_chunks.len() != blocks.len() || q_chunks.len() != blocks.len() {
        return Err(unsupported(
            "one fetched chunk per block and variable".into(),
        ));
    }
    let vocab = *p.shape.last().unwrap_or(&0);
    for b in blocks {
        let whole = b.last().is_some_and(|r| r.start == 0 && r.end == vocab);
        if vocab == 0 || !whole || !p.is_chunk(b) || !q.is_chunk(b) {
            return Err(unsupported(format!(
                "block {b:?} is not one chunk of whole rows of shape {:?}",
                p.shape
            )));
        }
    }
    let vocab = vocab as usize;
    let per_block: Vec<Result<Vec<f64>, Problem>> = parallel::install(|| {
        blocks
            .par_iter()
            .zip(p_chunks.par_iter().zip(q_chunks.par_iter()))
            .map(|(b, (pc, qc))| {
                let n: usize = b.iter().map(|r| (r.end - r.start) as usize).product();
                let rows = n / vocab;
                let want = n * itemsize(kind);
                let (pd, qd) = (direct::take(), direct::take());
                let mut bufs = (pd, qd);
                let out = decode(&mut bufs.0, pc, want, p.layout.crc32c)
                    .and_then(|()| decode(&mut bufs.1, qc, want, q.layout.crc32c))
                    .and_then(|()| {
                        if decode_only {
                            return Ok(vec![0.0; rows]);
                        }
                        // The block is one chunk: every element's key is that chunk's.
                        let (pk, qk) = (
                            |_: &[u64]| pc.key.to_string(),
                            |_: &[u64]| qc.key.to_string(),
                        );
                        let keys: (KeyOf, KeyOf) = (&pk, &qk);
                        let pair = (
                            rows_of(&bufs.0.decoded, kind, n),
                            rows_of(&bufs.1.decoded, kind, n),
                        );
                        consume(keys, b, pair, rows, vocab, tolerance)
                    });
                direct::give(bufs.0);
                direct::give(bufs.1);
                out
            })
            .collect()
    });
    let mut out = Vec::new();
    for r in per_block {
        out.extend(r?);
    }
    Ok(out)
}

fn decode(
    into: &mut direct::Buffers,
    chunk: &Fetched,
    want: usize,
    crc32c: bool,
) -> Result<(), Problem> {
    match chunk.bytes {
        Some(bytes) => into.decode_bytes(bytes, chunk.key, want, crc32c),
        None => Err(Problem::Missing {
            key: chunk.key.to_string(),
        }),
    }
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
        let v = RemoteVariable::new("p", META).unwrap();
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
        let at = |key, bytes: &'static [u8]| Fetched {
            key,
            bytes: Some(bytes),
        };
        let leak = |v: Vec<u8>| -> &'static [u8] { Box::leak(v.into_boxed_slice()) };
        let (p0, p1, q0, q1) = (leak(p0), leak(p1), leak(q0), leak(q1));
        let ps = [at("p/0.0", p0), at("p/1.0", p1)];
        let qs = [at("q/0.0", q0), at("q/1.0", q1)];
        let tv = chunks_tv((&v, &v), &blocks, (&ps, &qs), Dtype::F16, Some(1e-3), false);
        assert_eq!(tv.unwrap(), vec![1.0, 0.0]);
        // A missing object and a flipped byte are named by key.
        let gone = [
            at("p/0.0", p0),
            Fetched {
                key: "p/1.0",
                bytes: None,
            },
        ];
        let err = chunks_tv((&v, &v), &blocks, (&gone, &qs), Dtype::F16, None, false);
        assert!(matches!(err, Err(Problem::Missing { ref key }) if key == "p/1.0"));
        let mut bad = q1.to_vec();
        bad[3] ^= 1;
        let qs = [at("q/0.0", q0), at("q/1.0", leak(bad))];
        let err = chunks_tv((&v, &v), &blocks, (&ps, &qs), Dtype::F16, None, false);
        assert!(matches!(err, Err(Problem::Checksum { ref key, .. }) if key == "q/1.0"));
        // A block that is not one chunk is not read here.
        let two = vec![vec![0..2, 0..4]];
        let err = chunks_tv(
            (&v, &v),
            &two,
            (&ps[..1], &qs[..1]),
            Dtype::F16,
            None,
            false,
        );
        assert!(matches!(err, Err(Problem::Unsupported { .. })));
    }
}
