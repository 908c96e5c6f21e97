//! Whole chunks of the small variables (hazards, tokens, lengths, ...), decoded as they are
//! stored: one call reads a document's chunk of every variable at once, in parallel, from a
//! [`ChunkSource`] (a local store's files or fetched objects), with the checks of the
//! distributions' path (an absent chunk named, crc32c verified, the decoded size exact). The
//! caller views the bytes with the variable's dtype.
//!
//! Only the layout kvcouple writes is read here ([`crate::direct`]: `bytes` -> `zstd`
//! (-> `crc32c`), little endian); anything else is [`Problem::Unsupported`].

use std::collections::HashMap;

use rayon::prelude::*;
use zarrs::metadata::ArrayMetadata;

use kvcouple_core::parallel;

use crate::direct::{self, Layout};
use crate::source::ChunkSource;
use crate::Problem;

/// One chunk to decode: its key (relative to the store's root) and its variable's metadata
/// document (`zarr.json` or `.zarray`, as stored).
pub struct Chunk<'a> {
    pub key: &'a str,
    pub meta: &'a str,
}

/// The variable's layout, or unsupported.
fn layout_of(key: &str, meta: &str) -> Result<Layout, Problem> {
    let unsupported = |why: String| Problem::Unsupported {
        message: format!("chunk {key}: {why}"),
    };
    let parsed: ArrayMetadata =
        serde_json::from_str(meta).map_err(|e| unsupported(e.to_string()))?;
    direct::layout_any(&parsed)
        .ok_or_else(|| unsupported("not one zstd(+crc32c) chunk of fixed-size values".into()))
}

/// Every chunk's decoded bytes, in order; the first problem (in chunk order) otherwise.
pub fn decode_chunks(source: &dyn ChunkSource, chunks: &[Chunk]) -> Result<Vec<Vec<u8>>, Problem> {
    // A call holds many documents' chunks of a few variables: each metadata document is
    // parsed once.
    let mut parsed: HashMap<&str, Layout> = HashMap::new();
    let mut layouts: Vec<Layout> = Vec::with_capacity(chunks.len());
    for c in chunks {
        let layout = match parsed.get(c.meta) {
            Some(layout) => layout.clone(),
            None => {
                let layout = layout_of(c.key, c.meta)?;
                parsed.insert(c.meta, layout.clone());
                layout
            }
        };
        layouts.push(layout);
    }
    let decoded: Vec<Result<Vec<u8>, Problem>> = parallel::install(|| {
        chunks
            .par_iter()
            .zip(&layouts)
            .map(|(c, layout)| decode_one(source, c, layout))
            .collect()
    });
    decoded.into_iter().collect()
}

fn decode_one(source: &dyn ChunkSource, c: &Chunk, layout: &Layout) -> Result<Vec<u8>, Problem> {
    let want = layout.chunk.iter().product::<u64>() as usize * layout.itemsize;
    let mut buffers = direct::take();
    let result = buffers.decode(source, c.key, want, layout.crc32c);
    let out = result.map(|()| bytemuck::cast_slice::<u64, u8>(&buffers.decoded)[..want].to_vec());
    direct::give(buffers);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::FetchedObjects;

    const META: &str = r#"{"zarr_format": 3, "node_type": "array", "shape": [3, 4],
        "data_type": "int32", "fill_value": 0, "chunk_key_encoding": {"name": "default"},
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, 4]}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                   {"name": "zstd", "configuration": {"level": 1, "checksum": false}},
                   {"name": "crc32c"}]}"#;

    fn stored(values: &[i32]) -> Vec<u8> {
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = zstd::bulk::compress(&raw, 1).unwrap();
        out.extend_from_slice(&crc32c::crc32c(&out).to_le_bytes());
        out
    }

    /// Decode `keys` with `meta` from the fetched objects `stored`.
    fn decode(
        meta: &str,
        keys: &[&str],
        stored: &[(&str, Option<&[u8]>)],
    ) -> Result<Vec<Vec<u8>>, Problem> {
        let source = FetchedObjects::new(stored.iter().copied());
        let chunks: Vec<Chunk> = keys.iter().map(|key| Chunk { key, meta }).collect();
        decode_chunks(&source, &chunks)
    }

    #[test]
    fn chunks_decode_in_order_and_damage_is_named() {
        let (a, b) = (stored(&[1, -2, 3, 4]), stored(&[5, 6, 7, i32::MAX]));
        let both = [("t/c/1/0", Some(&b[..])), ("t/c/0/0", Some(&a[..]))];
        let got = decode(META, &["t/c/1/0", "t/c/0/0"], &both).unwrap();
        let ints = |v: &[u8]| -> Vec<i32> {
            v.chunks_exact(4)
                .map(|w| i32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect()
        };
        assert_eq!(ints(&got[0]), vec![5, 6, 7, i32::MAX]);
        assert_eq!(ints(&got[1]), vec![1, -2, 3, 4]);
        let mut flipped = a.clone();
        flipped[3] ^= 0x10;
        let damaged = [("t/c/0/0", Some(&b[..])), ("t/c/2/0", Some(&flipped[..]))];
        let err = decode(META, &["t/c/0/0", "t/c/2/0"], &damaged);
        assert!(matches!(err, Err(Problem::Checksum { ref key, .. }) if key == "t/c/2/0"));
        let err = decode(META, &["t/c/0/0"], &[("t/c/0/0", None)]);
        assert!(matches!(err, Err(Problem::Missing { ref key }) if key == "t/c/0/0"));
        // Three values where the chunk holds four: the size is checked.
        let short = stored(&[1, 2, 3]);
        let err = decode(META, &["t/c/0/0"], &[("t/c/0/0", Some(&short[..]))]);
        assert!(matches!(err, Err(Problem::Decode { .. })));
    }

    #[test]
    fn other_layouts_are_unsupported() {
        let gzip = META.replace(
            r#"{"name": "zstd", "configuration": {"level": 1, "checksum": false}}"#,
            r#"{"name": "gzip", "configuration": {"level": 1}}"#,
        );
        let strings = META.replace(r#""int32""#, r#""string""#);
        for meta in [gzip, strings] {
            let err = decode(&meta, &["t/c/0/0"], &[("t/c/0/0", Some(b""))]);
            assert!(matches!(err, Err(Problem::Unsupported { .. })));
        }
    }
}
