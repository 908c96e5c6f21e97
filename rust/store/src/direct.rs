//! The direct path for the layout kvcouple writes: one block is one chunk file, encoded
//! `bytes` (little endian) -> `zstd`, optionally followed by `crc32c` (Zarr v3), or a v2 array
//! with a zstd compressor and no filters. Such a chunk is read into a reused buffer, its
//! checksum verified, and decompressed straight into a reused, aligned buffer that the
//! kernels read in place: no fresh allocation per block (fresh multi-MB buffers cost a page
//! fault per 4 KiB), no copy from zarrs' output into aligned rows. Anything else (other
//! codecs, blocks that are not whole chunks) goes through zarrs
//! ([`crate::local::LocalVariable`]). Where the stored bytes come from is a [`ChunkSource`].
//!
//! The small variables may also be sharded (Zarr v3 `sharding_indexed`, [`Sharded`]): a shard
//! object holds many inner chunks of that layout and an index of their places; a shard is
//! read once, its index verified, and the inner chunks asked for decoded as above
//! ([`Buffers::decode_shard`]).

use std::sync::Mutex;

use serde_json::Value;
use zarrs::metadata::ArrayMetadata;

use crate::source::ChunkSource;
use crate::Problem;

/// What the direct path needs of a variable: its chunk shape, the decoded item size, and
/// whether a crc32c suffix follows the zstd frame.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Layout {
    pub chunk: Vec<u64>,
    pub itemsize: usize,
    pub crc32c: bool,
}

/// A codec's name (one without configuration may be written as its name alone: "crc32c").
fn codec_name(c: &Value) -> Option<&str> {
    c.as_str().or_else(|| c.get("name").and_then(Value::as_str))
}

fn codec_config(c: &Value) -> Value {
    c.get("configuration").cloned().unwrap_or(Value::Null)
}

/// `bytes` with little (or no) endianness.
fn is_little_bytes(c: &Value) -> bool {
    let config = codec_config(c);
    let endian = config.get("endian").and_then(Value::as_str);
    codec_name(c) == Some("bytes") && matches!(endian, None | Some("little"))
}

/// The standard crc32c codec: no configuration, the checksum a 4-byte suffix.
fn is_crc32c(c: &Value) -> bool {
    codec_name(c) == Some("crc32c") && codec_config(c).as_object().is_none_or(|m| m.is_empty())
}

/// Whether `codecs` are `bytes` (little endian) -> `zstd` (-> `crc32c`: Some(true)).
fn v3_codecs(codecs: &[Value]) -> Option<bool> {
    let (bytes, zstd, rest) = match codecs {
        [b, z, rest @ ..] => (b, z, rest),
        _ => return None,
    };
    if !is_little_bytes(bytes) || codec_name(zstd)? != "zstd" {
        return None;
    }
    match rest {
        [] => Some(false),
        [c] if is_crc32c(c) => Some(true),
        _ => None,
    }
}

/// The direct layout of an array of floats (the distributions), or None where it must go
/// through zarrs.
pub(crate) fn layout(meta: &ArrayMetadata) -> Option<Layout> {
    layout_with(meta, float_itemsize)
}

/// The direct layout of an array of any fixed-size number or bool (the small variables).
pub(crate) fn layout_any(meta: &ArrayMetadata) -> Option<Layout> {
    layout_with(meta, any_itemsize)
}

fn float_itemsize(dtype: &str) -> Option<usize> {
    match dtype {
        "float16" | "bfloat16" | "<f2" => Some(2),
        "float32" | "<f4" => Some(4),
        "float64" | "<f8" => Some(8),
        _ => None,
    }
}

fn any_itemsize(dtype: &str) -> Option<usize> {
    float_itemsize(dtype).or(match dtype {
        "bool" | "int8" | "uint8" | "|b1" | "|i1" | "|u1" => Some(1),
        "int16" | "uint16" | "<i2" | "<u2" => Some(2),
        "int32" | "uint32" | "<i4" | "<u4" => Some(4),
        "int64" | "uint64" | "<i8" | "<u8" => Some(8),
        _ => None,
    })
}

fn layout_with(meta: &ArrayMetadata, itemsize_of: fn(&str) -> Option<usize>) -> Option<Layout> {
    if cfg!(not(target_endian = "little")) {
        return None;
    }
    let json = serde_json::to_value(meta).ok()?;
    let (chunk, itemsize, crc32c) = match meta {
        ArrayMetadata::V3(_) => {
            let grid = json.get("chunk_grid")?;
            if grid.get("name")?.as_str()? != "regular" {
                return None;
            }
            let chunk = grid.get("configuration")?.get("chunk_shape")?;
            let itemsize = itemsize_of(json.get("data_type")?.as_str()?)?;
            let transformers = json.get("storage_transformers");
            if transformers
                .and_then(Value::as_array)
                .is_some_and(|t| !t.is_empty())
            {
                return None;
            }
            (
                chunk.clone(),
                itemsize,
                v3_codecs(json.get("codecs")?.as_array()?)?,
            )
        }
        ArrayMetadata::V2(_) => {
            let itemsize = itemsize_of(json.get("dtype")?.as_str()?)?;
            let order = json.get("order").and_then(Value::as_str).unwrap_or("C");
            let filters = json.get("filters").and_then(Value::as_array);
            let compressor = json.get("compressor")?;
            if order != "C"
                || filters.is_some_and(|f| !f.is_empty())
                || compressor.get("id")?.as_str()? != "zstd"
            {
                return None;
            }
            (json.get("chunks")?.clone(), itemsize, false)
        }
    };
    let chunk: Option<Vec<u64>> = chunk.as_array()?.iter().map(Value::as_u64).collect();
    Some(Layout {
        chunk: chunk?,
        itemsize,
        crc32c,
    })
}

/// A sharded array (Zarr v3 `sharding_indexed`, the only codec) whose inner chunks are the
/// direct layout, and whose index is `bytes` (little endian) (-> `crc32c`), at the shard's end
/// or start: `per_shard` entries of (offset, nbytes), u64 little endian, offsets from the
/// shard's start, both `u64::MAX` for an absent inner chunk.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sharded {
    /// The inner chunks' layout (`inner.chunk`: the inner chunk shape).
    pub inner: Layout,
    /// An inner chunk's decoded size in bytes.
    pub inner_bytes: usize,
    /// Inner chunks per shard: the index's entries, in C order of the inner chunk grid.
    pub per_shard: u64,
    pub index_at_end: bool,
    pub index_crc32c: bool,
}

/// The sharded direct layout of an array of any fixed-size number or bool, or None.
pub(crate) fn sharded_any(meta: &ArrayMetadata) -> Option<Sharded> {
    if cfg!(not(target_endian = "little")) || !matches!(meta, ArrayMetadata::V3(_)) {
        return None;
    }
    let json = serde_json::to_value(meta).ok()?;
    let grid = json.get("chunk_grid")?;
    if grid.get("name")?.as_str()? != "regular" {
        return None;
    }
    let shard = u64s(grid.get("configuration")?.get("chunk_shape")?)?;
    let itemsize = any_itemsize(json.get("data_type")?.as_str()?)?;
    let transformers = json.get("storage_transformers");
    if transformers
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
    {
        return None;
    }
    // Sharding alone: codecs around it (a transpose, a checksum of the whole shard) are
    // zarrs' to read.
    let [sharding] = json.get("codecs")?.as_array()?.as_slice() else {
        return None;
    };
    if codec_name(sharding)? != "sharding_indexed" {
        return None;
    }
    let config = codec_config(sharding);
    let chunk = u64s(config.get("chunk_shape")?)?;
    if chunk.len() != shard.len() || chunk.contains(&0) {
        return None;
    }
    let mut per_shard: u64 = 1;
    for (s, c) in shard.iter().zip(&chunk) {
        if s % c != 0 {
            return None;
        }
        per_shard = per_shard.checked_mul(s / c)?;
    }
    // The index and an inner chunk must be addressable (their sizes computable) here.
    usize::try_from(per_shard).ok()?.checked_mul(16)?;
    let inner_bytes = chunk
        .iter()
        .try_fold(itemsize, |n, &c| n.checked_mul(usize::try_from(c).ok()?))?;
    let crc32c = v3_codecs(config.get("codecs")?.as_array()?)?;
    let index_crc32c = match config.get("index_codecs")?.as_array()?.as_slice() {
        [b] if is_little_bytes(b) => false,
        [b, c] if is_little_bytes(b) && is_crc32c(c) => true,
        _ => return None,
    };
    let index_at_end = match config.get("index_location").and_then(Value::as_str) {
        None | Some("end") => true,
        Some("start") => false,
        Some(_) => return None,
    };
    Some(Sharded {
        inner: Layout {
            chunk,
            itemsize,
            crc32c,
        },
        inner_bytes,
        per_shard,
        index_at_end,
        index_crc32c,
    })
}

fn u64s(v: &Value) -> Option<Vec<u64>> {
    v.as_array()?.iter().map(Value::as_u64).collect()
}

impl Sharded {
    /// The index's size in bytes (its checksum included).
    fn index_len(&self) -> usize {
        // Checked to fit when the layout was read.
        self.per_shard as usize * 16 + if self.index_crc32c { 4 } else { 0 }
    }

    /// The index entries of the shard object `object` (key `key`), its checksum verified, and
    /// the range of the object the inner chunks may lie in.
    fn index<'a>(
        &self,
        key: &str,
        object: &'a [u8],
    ) -> Result<(&'a [u8], std::ops::Range<usize>), Problem> {
        let len = self.index_len();
        if object.len() < len {
            return Err(Problem::Decode {
                key: key.to_string(),
                message: format!(
                    "{} bytes, shorter than the shard's index ({len} bytes)",
                    object.len()
                ),
            });
        }
        let (index, data) = if self.index_at_end {
            let split = object.len() - len;
            (&object[split..], 0..split)
        } else {
            (&object[..len], len..object.len())
        };
        let entries = &index[..self.per_shard as usize * 16];
        if self.index_crc32c {
            let stored = u32::from_le_bytes(index[len - 4..].try_into().expect("4 bytes"));
            let computed = crc32c::crc32c(entries);
            if stored != computed {
                return Err(Problem::Checksum {
                    key: key.to_string(),
                    message: format!(
                        "the shard index: crc32c checksum {computed:#010x} of its bytes, \
                         {stored:#010x} stored"
                    ),
                });
            }
        }
        Ok((entries, data))
    }
}

/// Inner chunk `inner`'s place in a shard: its byte range, None where it is absent.
fn inner_range(
    key: &str,
    entries: &[u8],
    data: &std::ops::Range<usize>,
    inner: u64,
) -> Result<Option<std::ops::Range<usize>>, Problem> {
    let entry = usize::try_from(inner)
        .ok()
        .and_then(|i| entries.get(i.checked_mul(16)?..i.checked_mul(16)? + 16));
    let Some(entry) = entry else {
        return Err(Problem::Unsupported {
            message: format!(
                "chunk {key}: inner chunk {inner} asked of a shard of {} inner chunks",
                entries.len() / 16
            ),
        });
    };
    let word = |i: usize| u64::from_le_bytes(entry[i..i + 8].try_into().expect("8 bytes"));
    let (offset, nbytes) = (word(0), word(8));
    if offset == u64::MAX && nbytes == u64::MAX {
        return Ok(None);
    }
    let range = usize::try_from(offset)
        .ok()
        .zip(usize::try_from(nbytes).ok())
        .and_then(|(o, n)| Some(o..o.checked_add(n)?))
        .filter(|r| data.start <= r.start && r.end <= data.end);
    range.map(Some).ok_or_else(|| Problem::Decode {
        key: key.to_string(),
        message: format!(
            "inner chunk {inner}: the shard's index puts it at bytes {offset}..+{nbytes}, \
             outside the chunks' {}..{} of the shard",
            data.start, data.end
        ),
    })
}

/// `p` of inner chunk `inner` of its shard, the inner chunk named in its message.
fn of_inner(p: Problem, inner: u64) -> Problem {
    match p {
        Problem::Checksum { key, message } => Problem::Checksum {
            key,
            message: format!("inner chunk {inner}: {message}"),
        },
        Problem::Decode { key, message } => Problem::Decode {
            key,
            message: format!("inner chunk {inner}: {message}"),
        },
        other => other,
    }
}

/// One thread's buffers: the chunk file as read (local stores), and its decoded values (8-byte aligned,
/// so that every stored float format can be viewed in place).
#[derive(Default)]
pub(crate) struct Buffers {
    file: Vec<u8>,
    pub decoded: Vec<u64>,
    zstd: Option<zstd::bulk::Decompressor<'static>>,
}

// Buffer sets waiting for a task: taken at the start of a block and given back at its end,
// so a task that rayon runs nested inside another (work stealing) simply gets its own set.
static FREE: Mutex<Vec<Buffers>> = Mutex::new(Vec::new());
// Sets kept between blocks: enough for a pair per thread of a large machine.
const KEEP: usize = 256;

pub(crate) fn take() -> Buffers {
    FREE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop()
        .unwrap_or_default()
}

pub(crate) fn give(b: Buffers) {
    let mut free = FREE.lock().unwrap_or_else(|e| e.into_inner());
    if free.len() < KEEP {
        free.push(b);
    }
}

impl Buffers {
    /// The chunk object `key` of `source`, its `want` bytes decoded into `self.decoded` (the
    /// first `want` bytes of it).
    pub fn decode(
        &mut self,
        source: &dyn ChunkSource,
        key: &str,
        want: usize,
        crc32c: bool,
    ) -> Result<(), Problem> {
        let mut file = std::mem::take(&mut self.file);
        let out = source
            .stored(key, &mut file)
            .and_then(|bytes| self.decode_stored(bytes, key, want, crc32c));
        self.file = file;
        out
    }

    /// The inner chunks `inners` (linear indices, each < `shard.per_shard`) of the shard
    /// object `key` of `source`, each decoded and checked as [`Self::decode`] does, in order:
    /// inner chunk `inners[j]`'s bytes are handed to `emit(j, bytes)`. The outer error is the
    /// shard's (absent object, damaged index); an inner chunk's problem names the shard's key
    /// and the inner chunk (an absent one: "`key` (inner chunk i)", as [`Problem::Missing`]
    /// has no message).
    pub fn decode_shard(
        &mut self,
        source: &dyn ChunkSource,
        key: &str,
        shard: &Sharded,
        inners: &[u64],
        mut emit: impl FnMut(usize, &[u8]),
    ) -> Result<Vec<Result<(), Problem>>, Problem> {
        let want = shard.inner_bytes;
        let mut file = std::mem::take(&mut self.file);
        let out = source.stored(key, &mut file).and_then(|object| {
            let (entries, data) = shard.index(key, object)?;
            Ok(inners
                .iter()
                .enumerate()
                .map(|(j, &inner)| {
                    let Some(range) = inner_range(key, entries, &data, inner)? else {
                        return Err(Problem::Missing {
                            key: format!("{key} (inner chunk {inner})"),
                        });
                    };
                    self.decode_stored(&object[range], key, want, shard.inner.crc32c)
                        .map_err(|p| of_inner(p, inner))?;
                    emit(j, &bytemuck::cast_slice::<u64, u8>(&self.decoded)[..want]);
                    Ok(())
                })
                .collect())
        });
        self.file = file;
        out
    }

    /// Decode the stored chunk `bytes` (key `key`): its crc32c verified where it has one, its
    /// `want` bytes into `self.decoded`.
    fn decode_stored(
        &mut self,
        bytes: &[u8],
        key: &str,
        want: usize,
        crc32c: bool,
    ) -> Result<(), Problem> {
        let failed = |message: String| Problem::Decode {
            key: key.to_string(),
            message,
        };
        let mut frame: &[u8] = bytes;
        if crc32c {
            let Some(split) = frame.len().checked_sub(4) else {
                return Err(failed(format!(
                    "{} bytes, shorter than its checksum",
                    frame.len()
                )));
            };
            let (data, stored) = frame.split_at(split);
            let stored = u32::from_le_bytes([stored[0], stored[1], stored[2], stored[3]]);
            let computed = crc32c::crc32c(data);
            if stored != computed {
                return Err(Problem::Checksum {
                    key: key.to_string(),
                    message: format!(
                        "crc32c checksum {computed:#010x} of the chunk's bytes, {stored:#010x} stored"
                    ),
                });
            }
            frame = data;
        }
        let words = want.div_ceil(8);
        if self.decoded.len() < words {
            self.decoded.resize(words, 0);
        }
        if self.zstd.is_none() {
            self.zstd = Some(zstd::bulk::Decompressor::new().map_err(|e| failed(e.to_string()))?);
        }
        let dz = self.zstd.as_mut().expect("set just above");
        let out = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.decoded)[..want];
        match dz.decompress_to_buffer(frame, out) {
            Ok(n) if n == want => Ok(()),
            Ok(n) => Err(failed(format!("decoded {n} bytes, expected {want}"))),
            Err(e) => {
                let message = format!("zstd: {e}");
                if message.to_lowercase().contains("checksum") {
                    Err(Problem::Checksum {
                        key: key.to_string(),
                        message,
                    })
                } else {
                    Err(failed(message))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::LocalFiles;

    fn v3(codecs: &str) -> ArrayMetadata {
        let json = format!(
            r#"{{"zarr_format": 3, "node_type": "array", "shape": [4, 8], "data_type": "float16",
            "chunk_grid": {{"name": "regular", "configuration": {{"chunk_shape": [2, 8]}}}},
            "chunk_key_encoding": {{"name": "default"}}, "fill_value": 0.0, "codecs": {codecs}}}"#
        );
        serde_json::from_str(&json).unwrap()
    }

    #[test]
    fn layouts_kvcouple_writes_are_direct_and_others_not() {
        let bytes = r#"{"name": "bytes", "configuration": {"endian": "little"}}"#;
        let zstd = r#"{"name": "zstd", "configuration": {"level": 1, "checksum": false}}"#;
        let with_crc = v3(&format!(r#"[{bytes}, {zstd}, {{"name": "crc32c"}}]"#));
        assert_eq!(
            layout(&with_crc),
            Some(Layout {
                chunk: vec![2, 8],
                itemsize: 2,
                crc32c: true
            })
        );
        let plain = layout(&v3(&format!("[{bytes}, {zstd}]"))).unwrap();
        assert!(!plain.crc32c);
        let gzip = r#"{"name": "gzip", "configuration": {"level": 1}}"#;
        assert_eq!(layout(&v3(&format!("[{bytes}, {gzip}]"))), None);
        let big = r#"{"name": "bytes", "configuration": {"endian": "big"}}"#;
        assert_eq!(layout(&v3(&format!("[{big}, {zstd}]"))), None);
    }

    #[test]
    fn decodes_verifies_and_names_the_chunk() {
        let dir = std::env::temp_dir().join(format!("kvcouple-direct-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let raw: Vec<u8> = (0..4096u32)
            .flat_map(|i| (i as u16).to_le_bytes())
            .collect();
        let mut file = zstd::bulk::compress(&raw, 1).unwrap();
        file.extend_from_slice(&crc32c::crc32c(&file).to_le_bytes());
        let path = dir.join("p").join("0.0");
        std::fs::create_dir_all(dir.join("p")).unwrap();
        std::fs::write(&path, &file).unwrap();
        let files = LocalFiles::new(&dir);
        let mut b = take();
        b.decode(&files, "p/0.0", raw.len(), true).unwrap();
        assert_eq!(
            &bytemuck::cast_slice::<u64, u8>(&b.decoded)[..raw.len()],
            &raw[..]
        );
        // A flipped byte fails the checksum; a wrong size and an absent file are named too.
        file[10] ^= 1;
        std::fs::write(&path, &file).unwrap();
        let err = b.decode(&files, "p/0.0", raw.len(), true).unwrap_err();
        assert!(matches!(err, Problem::Checksum { ref key, .. } if key == "p/0.0"));
        file[10] ^= 1;
        std::fs::write(&path, &file).unwrap();
        let err = b.decode(&files, "p/0.0", raw.len() - 2, true).unwrap_err();
        assert!(matches!(err, Problem::Decode { .. }));
        let err = b.decode(&files, "p/1.0", raw.len(), true).unwrap_err();
        assert!(matches!(err, Problem::Missing { ref key } if key == "p/1.0"));
        give(b);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
