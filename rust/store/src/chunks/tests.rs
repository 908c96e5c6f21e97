//! `decode_chunks` on fetched objects: chunks and shards in order, damage named, other
//! layouts unsupported, and no panic on bad offsets.

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
    let chunks: Vec<Chunk> = keys
        .iter()
        .map(|key| Chunk {
            key,
            meta,
            inner: None,
        })
        .collect();
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
fn chunks_of_several_variables_in_any_order_each_read_with_their_own_layout() {
    // Two variables of the same key prefix: `t` of four int32 per chunk and `w` of two.
    // Their metadata documents come as separate copies of equal text (not the same
    // slice) and the chunks alternate: each chunk is read with its own layout.
    let two = META.replace("[1, 4]", "[1, 2]");
    let (t_copy, w_copy) = (META.to_string(), two.clone());
    let (a, b) = (stored(&[1, 2, 3, 4]), stored(&[8, 9]));
    let objects = [("t/c/0/0", Some(&a[..])), ("w/c/0/0", Some(&b[..]))];
    let source = FetchedObjects::new(objects.iter().copied());
    let chunks = [
        Chunk {
            key: "t/c/0/0",
            meta: META,
            inner: None,
        },
        Chunk {
            key: "w/c/0/0",
            meta: &two,
            inner: None,
        },
        Chunk {
            key: "t/c/0/0",
            meta: &t_copy,
            inner: None,
        },
        Chunk {
            key: "w/c/0/0",
            meta: &w_copy,
            inner: None,
        },
        Chunk {
            key: "w/c/0/0",
            meta: &two,
            inner: None,
        },
    ];
    let got = decode_chunks(&source, &chunks).unwrap();
    let lens: Vec<usize> = got.iter().map(Vec::len).collect();
    assert_eq!(lens, vec![16, 8, 16, 8, 8]);
    assert_eq!(got[0], got[2]);
    assert_eq!(got[1], got[4]);
    // The same chunk asked with the other variable's layout is refused, not misread.
    let wrong = [Chunk {
        key: "t/c/0/0",
        meta: &two,
        inner: None,
    }];
    assert!(matches!(
        decode_chunks(&source, &wrong),
        Err(Problem::Decode { .. })
    ));
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

// Shards of 2 documents x 2 policies, an inner chunk per (document, policy) of 3 int32s:
// what zarr-python 3 writes with shards=(2, 2, 3), chunks=(1, 1, 3).
const SHARDED: &str = r#"{"zarr_format": 3, "node_type": "array", "shape": [4, 2, 3],
    "data_type": "int32", "fill_value": 0,
    "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 2, 3]}},
    "codecs": [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [1, 1, 3],
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                   {"name": "zstd", "configuration": {"level": 1, "checksum": false}},
                   {"name": "crc32c"}],
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                         {"name": "crc32c"}],
        "index_location": "end"}}],
    "dimension_names": ["doc", "policy", "rep"]}"#;

/// A shard object of the inner chunks `inner` (None: absent), its index at the end (or
/// the start), as zarr-python writes it.
fn shard(inner: &[Option<Vec<u8>>], at_end: bool) -> Vec<u8> {
    let index_len = inner.len() as u64 * 16 + 4;
    let mut data = Vec::new();
    let mut entries = Vec::new();
    let base = if at_end { 0 } else { index_len };
    for chunk in inner {
        let (offset, nbytes) = match chunk {
            Some(bytes) => {
                let at = base + data.len() as u64;
                data.extend_from_slice(bytes);
                (at, bytes.len() as u64)
            }
            None => (u64::MAX, u64::MAX),
        };
        entries.extend_from_slice(&offset.to_le_bytes());
        entries.extend_from_slice(&nbytes.to_le_bytes());
    }
    entries.extend_from_slice(&crc32c::crc32c(&entries).to_le_bytes());
    if at_end {
        [data, entries].concat()
    } else {
        [entries, data].concat()
    }
}

/// Shard `i` of the test array: inner chunk j holds [10 i + j, -j, 7].
fn shard_values(i: i32) -> Vec<Option<Vec<u8>>> {
    (0..4).map(|j| Some(stored(&[10 * i + j, -j, 7]))).collect()
}

/// Decode (shard key, inner index) of `SHARDED`-like `meta` from the objects `stored`.
/// The key and message of a checksum problem (any other answer fails the test).
fn checksum(answer: Result<Vec<Vec<i32>>, Problem>) -> (String, String) {
    match answer {
        Err(Problem::Checksum { key, message }) => (key, message),
        other => panic!("{other:?}"),
    }
}

fn decode_inner(
    meta: &str,
    asked: &[(&str, u64)],
    stored: &[(&str, Option<&[u8]>)],
) -> Result<Vec<Vec<i32>>, Problem> {
    let source = FetchedObjects::new(stored.iter().copied());
    let chunks: Vec<Chunk> = asked
        .iter()
        .map(|&(key, inner)| Chunk {
            key,
            meta,
            inner: Some(inner),
        })
        .collect();
    let got = decode_chunks(&source, &chunks)?;
    Ok(got.iter().map(|v| ints(v)).collect())
}

/// Little-endian int32 values.
fn ints(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|w| i32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect()
}

#[test]
fn inner_chunks_of_shards_decode_in_order() {
    for at_end in [true, false] {
        let meta = if at_end {
            SHARDED.to_string()
        } else {
            SHARDED.replace(r#""index_location": "end""#, r#""index_location": "start""#)
        };
        let (s0, s1) = (
            shard(&shard_values(0), at_end),
            shard(&shard_values(1), at_end),
        );
        let objects = [("h/0.0.0", Some(&s0[..])), ("h/1.0.0", Some(&s1[..]))];
        let asked = [
            ("h/1.0.0", 3),
            ("h/0.0.0", 0),
            ("h/1.0.0", 0),
            ("h/0.0.0", 2),
        ];
        let got = decode_inner(&meta, &asked, &objects).unwrap();
        assert_eq!(
            got,
            vec![
                vec![13, -3, 7],
                vec![0, 0, 7],
                vec![10, 0, 7],
                vec![2, -2, 7]
            ],
            "index at the end: {at_end}"
        );
    }
    // Several objects, and several inner chunks of one, are read once each (here: the
    // shard read by a source that counts).
    let s0 = shard(&shard_values(0), true);
    let counting = Counting::new(&s0);
    let chunks: Vec<Chunk> = (0..4)
        .map(|j| Chunk {
            key: "h/0.0.0",
            meta: SHARDED,
            inner: Some(j),
        })
        .collect();
    assert_eq!(decode_chunks(&counting, &chunks).unwrap().len(), 4);
    assert_eq!(counting.reads.load(std::sync::atomic::Ordering::Relaxed), 1);
}

/// A source of one object ("h/0.0.0") that counts its reads.
struct Counting<'a> {
    object: &'a [u8],
    reads: std::sync::atomic::AtomicUsize,
}

impl<'a> Counting<'a> {
    fn new(object: &'a [u8]) -> Self {
        Self {
            object,
            reads: Default::default(),
        }
    }
}

impl ChunkSource for Counting<'_> {
    fn stored<'a>(&'a self, key: &str, _: &'a mut Vec<u8>) -> Result<&'a [u8], Problem> {
        assert_eq!(key, "h/0.0.0");
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.object)
    }
}

#[test]
fn a_damaged_inner_chunk_is_named_by_shard_and_index() {
    let mut inner = shard_values(1);
    let chunk = inner[2].as_mut().unwrap();
    chunk[2] ^= 0x10;
    let s1 = shard(&inner, true);
    let objects = [("h/1.0.0", Some(&s1[..]))];
    // Inner chunks 0 and 1 are intact; 2 is the first problem in the order asked.
    let ok = decode_inner(SHARDED, &[("h/1.0.0", 0), ("h/1.0.0", 1)], &objects).unwrap();
    assert_eq!(ok[1], vec![11, -1, 7]);
    let err = decode_inner(SHARDED, &[("h/1.0.0", 3), ("h/1.0.0", 2)], &objects);
    let (key, message) = checksum(err);
    assert_eq!(key, "h/1.0.0");
    assert!(message.starts_with("inner chunk 2: crc32c"), "{message}");
}

#[test]
fn absent_shards_and_inner_chunks_are_missing() {
    let mut inner = shard_values(0);
    inner[1] = None;
    let s0 = shard(&inner, true);
    let objects = [("h/0.0.0", Some(&s0[..])), ("h/1.0.0", None)];
    let err = decode_inner(SHARDED, &[("h/0.0.0", 0), ("h/0.0.0", 1)], &objects);
    assert_eq!(
        err,
        Err(Problem::Missing {
            key: "h/0.0.0 (inner chunk 1)".into()
        })
    );
    let err = decode_inner(SHARDED, &[("h/0.0.0", 0), ("h/1.0.0", 1)], &objects);
    assert_eq!(
        err,
        Err(Problem::Missing {
            key: "h/1.0.0".into()
        })
    );
    // One offset absent but not the other is damage, not absence.
    let mut half = s0.clone();
    let at = s0.len() - 4 - 4 * 16 + 16; // inner chunk 1's offset
    half[at..at + 8].copy_from_slice(&5u64.to_le_bytes());
    let crc = crc32c::crc32c(&half[s0.len() - 68..s0.len() - 4]);
    let end = half.len();
    half[end - 4..].copy_from_slice(&crc.to_le_bytes());
    let err = decode_inner(SHARDED, &[("h/0.0.0", 1)], &[("h/0.0.0", Some(&half[..]))]);
    assert!(
        matches!(err, Err(Problem::Decode { ref message, .. }) if message.contains("inner chunk 1")),
        "{err:?}"
    );
}

#[test]
fn a_bad_index_checksum_is_refused() {
    let mut s0 = shard(&shard_values(0), true);
    let at = s0.len() - 20; // inside the last entry
    s0[at] ^= 1;
    let err = decode_inner(SHARDED, &[("h/0.0.0", 0)], &[("h/0.0.0", Some(&s0[..]))]);
    let (key, message) = checksum(err);
    assert_eq!(key, "h/0.0.0");
    assert!(message.contains("shard index"), "{message}");
}

#[test]
fn truncated_shards_are_refused() {
    let s0 = shard(&shard_values(0), true);
    // Shorter than its index.
    let err = decode_inner(SHARDED, &[("h/0.0.0", 0)], &[("h/0.0.0", Some(&s0[..40]))]);
    assert!(
        matches!(err, Err(Problem::Decode { ref key, .. }) if key == "h/0.0.0"),
        "{err:?}"
    );
    // The index intact, the chunks before it cut short: the last one now runs into it.
    let cut = [&s0[..s0.len() - 68 - 5], &s0[s0.len() - 68..]].concat();
    let ok = decode_inner(SHARDED, &[("h/0.0.0", 0)], &[("h/0.0.0", Some(&cut[..]))]);
    assert_eq!(ok.unwrap(), vec![vec![0, 0, 7]]);
    let err = decode_inner(SHARDED, &[("h/0.0.0", 3)], &[("h/0.0.0", Some(&cut[..]))]);
    assert!(
        matches!(err, Err(Problem::Decode { ref message, .. }) if message.contains("inner chunk 3")),
        "{err:?}"
    );
    let err = decode_inner(SHARDED, &[("h/0.0.0", 0)], &[("h/0.0.0", Some(&[][..]))]);
    assert!(matches!(err, Err(Problem::Decode { .. })), "{err:?}");
}

/// `object` with inner chunk `j`'s index entry set to (offset, nbytes), its checksum
/// made valid again (the damage an index checksum cannot see: a hostile writer).
fn with_entry(object: &[u8], j: usize, offset: u64, nbytes: u64) -> Vec<u8> {
    let mut out = object.to_vec();
    let start = out.len() - 68;
    out[start + 16 * j..start + 16 * j + 8].copy_from_slice(&offset.to_le_bytes());
    out[start + 16 * j + 8..start + 16 * j + 16].copy_from_slice(&nbytes.to_le_bytes());
    let crc = crc32c::crc32c(&out[start..start + 64]);
    let end = out.len();
    out[end - 4..].copy_from_slice(&crc.to_le_bytes());
    out
}

#[test]
fn offsets_out_of_range_are_refused_without_panic() {
    let s0 = shard(&shard_values(0), true);
    let len = s0.len() as u64;
    for (offset, nbytes) in [
        (len, 4),           // beyond the object
        (len - 70, 10),     // into the index
        (u64::MAX - 3, 10), // overflows
        (3, u64::MAX - 1),  // overflows
        (0, u64::MAX),      // one half absent
    ] {
        let bad = with_entry(&s0, 2, offset, nbytes);
        let err = decode_inner(SHARDED, &[("h/0.0.0", 2)], &[("h/0.0.0", Some(&bad[..]))]);
        assert!(
            matches!(err, Err(Problem::Decode { ref key, ref message })
                if key == "h/0.0.0" && message.contains("inner chunk 2")),
            "{offset} {nbytes}: {err:?}"
        );
    }
    // An empty range is in range, but no inner chunk: it does not decode.
    let bad = with_entry(&s0, 2, 0, 0);
    let err = decode_inner(SHARDED, &[("h/0.0.0", 2)], &[("h/0.0.0", Some(&bad[..]))]);
    assert!(matches!(err, Err(Problem::Decode { .. })), "{err:?}");
}

#[test]
fn sharded_layouts_are_read_or_unsupported() {
    let s0 = shard(&shard_values(0), true);
    let objects = [("h/0.0.0", Some(&s0[..]))];
    // An inner index is needed for a sharded array, and in range; none for another.
    for (meta, inner) in [(SHARDED, None), (SHARDED, Some(4)), (META, Some(0))] {
        let source = FetchedObjects::new(objects.iter().copied());
        let chunk = Chunk {
            key: "h/0.0.0",
            meta,
            inner,
        };
        let err = decode_chunks(&source, &[chunk]);
        assert!(matches!(err, Err(Problem::Unsupported { .. })), "{err:?}");
    }
    let gzip_inside = SHARDED.replace(
        r#"{"name": "zstd", "configuration": {"level": 1, "checksum": false}}"#,
        r#"{"name": "gzip", "configuration": {"level": 1}}"#,
    );
    let index_zstd = SHARDED.replace(
        r#"{"name": "crc32c"}],
        "index_location""#,
        r#"{"name": "zstd", "configuration": {"level": 1, "checksum": false}}],
        "index_location""#,
    );
    let uneven = SHARDED.replace(
        r#""chunk_shape": [1, 1, 3],"#,
        r#""chunk_shape": [1, 1, 2],"#,
    );
    let middle = SHARDED.replace(r#""end""#, r#""middle""#);
    for meta in [gzip_inside, index_zstd, uneven, middle] {
        assert_ne!(meta, SHARDED);
        let err = decode_inner(&meta, &[("h/0.0.0", 0)], &objects);
        assert!(
            matches!(err, Err(Problem::Unsupported { .. })),
            "{meta}: {err:?}"
        );
    }
    // Without crc32c on the index (and the index at the end by default).
    let plain_index = SHARDED
        .replace(
            r#",
                         {"name": "crc32c"}],"#,
            "],",
        )
        .replace(
            r#",
        "index_location": "end""#,
            "",
        );
    assert_ne!(plain_index, SHARDED);
    let mut object = s0[..s0.len() - 4].to_vec();
    let got = decode_inner(
        &plain_index,
        &[("h/0.0.0", 1)],
        &[("h/0.0.0", Some(&object[..]))],
    );
    assert_eq!(got.unwrap(), vec![vec![1, -1, 7]]);
    object.truncate(3);
    let err = decode_inner(
        &plain_index,
        &[("h/0.0.0", 1)],
        &[("h/0.0.0", Some(&object[..]))],
    );
    assert!(matches!(err, Err(Problem::Decode { .. })), "{err:?}");
}

#[test]
fn runs_are_the_chunks_one_after_another_and_the_first_problem_is_in_chunk_order() {
    let (s0, s1) = (shard(&shard_values(0), true), shard(&shard_values(1), true));
    let (a, b) = (stored(&[1, -2, 3, 4]), stored(&[5, 6, 7, i32::MAX]));
    let objects = [
        ("h/0.0.0", Some(&s0[..])),
        ("h/1.0.0", Some(&s1[..])),
        ("t/c/0/0", Some(&a[..])),
        ("t/c/1/0", Some(&b[..])),
    ];
    let source = FetchedObjects::new(objects.iter().copied());
    // Two variables' chunks of three "documents", inner chunks out of their shards' order and
    // one object asked twice: every grouping of them gives the same bytes as chunk by chunk.
    let chunks = [
        Chunk {
            key: "h/1.0.0",
            meta: SHARDED,
            inner: Some(3),
        },
        Chunk {
            key: "h/0.0.0",
            meta: SHARDED,
            inner: Some(0),
        },
        Chunk {
            key: "h/1.0.0",
            meta: SHARDED,
            inner: Some(0),
        },
        Chunk {
            key: "t/c/1/0",
            meta: META,
            inner: None,
        },
        Chunk {
            key: "t/c/0/0",
            meta: META,
            inner: None,
        },
        Chunk {
            key: "t/c/1/0",
            meta: META,
            inner: None,
        },
    ];
    let each = decode_chunks(&source, &chunks).unwrap();
    let values: Vec<Vec<i32>> = each.iter().map(|v| ints(v)).collect();
    let (x, y) = (vec![1, -2, 3, 4], vec![5, 6, 7, i32::MAX]);
    assert_eq!(
        values,
        vec![
            vec![13, -3, 7],
            vec![0, 0, 7],
            vec![10, 0, 7],
            y.clone(),
            x,
            y
        ]
    );
    for lengths in [
        vec![1; 6],
        vec![2, 2, 2],
        vec![3, 3],
        vec![4, 2],
        vec![6],
        vec![1, 4, 1],
        vec![0, 5, 0, 1],
    ] {
        let runs = decode_runs(&source, &chunks, &lengths).unwrap();
        let mut at = 0;
        let expected: Vec<Vec<u8>> = lengths
            .iter()
            .map(|&len| {
                at += len;
                each[at - len..at].concat()
            })
            .collect();
        assert_eq!(runs, expected, "runs of {lengths:?}");
    }
    // Lengths that do not add up to the chunks are refused, not a panic.
    for lengths in [vec![], vec![5], vec![4, 3]] {
        let err = decode_runs(&source, &chunks, &lengths);
        assert!(
            matches!(err, Err(Problem::Unsupported { .. })),
            "{lengths:?}: {err:?}"
        );
    }
    // The fifth chunk damaged and the first and third chunks' shard absent: the first is
    // named, whatever the runs.
    let mut flipped = a.clone();
    flipped[3] ^= 0x10;
    let damaged = [
        ("h/0.0.0", Some(&s0[..])),
        ("t/c/0/0", Some(&flipped[..])),
        ("t/c/1/0", Some(&b[..])),
    ];
    let source = FetchedObjects::new(damaged.iter().copied());
    for lengths in [vec![1; 6], vec![2, 2, 2], vec![3, 3], vec![6], vec![1, 5]] {
        let err = decode_runs(&source, &chunks, &lengths);
        assert!(
            matches!(err, Err(Problem::Missing { ref key }) if key == "h/1.0.0"),
            "runs of {lengths:?}: {err:?}"
        );
    }
    let err = decode_runs(&source, &chunks[3..], &[2, 1]);
    assert!(matches!(err, Err(Problem::Checksum { ref key, .. }) if key == "t/c/0/0"));
}
