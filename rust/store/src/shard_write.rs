//! Writing a Zarr v3 shard whole: the encoder behind the writer of sharded trace stores.
//!
//! A shard (codec `sharding_indexed`, index at the end) is the encoded inner chunks one after
//! another, then the index: for each inner chunk, in C order of the shard's inner grid, its
//! offset and size in bytes (u64 little endian; both `u64::MAX` for an absent chunk), then the
//! index's crc32c (little endian). Each inner chunk is encoded as kvcouple's layout stores it
//! ([`crate::direct`]): the values little endian, Zstd, then the crc32c of the compressed
//! bytes. zarr-python encodes inner chunks one by one through its codec pipeline (~0.4 ms
//! each); here they are compressed in parallel with the GIL released.

use rayon::prelude::*;

use kvcouple_core::parallel;

use crate::Problem;

/// The shard of one variable to encode: its values (C order, little endian, the whole shard
/// shape; rows past `present` along the first axis are outside the array and not stored).
pub struct ShardValues<'a> {
    pub data: &'a [u8],
    pub itemsize: usize,
    pub shard: &'a [usize],
    pub inner: &'a [usize],
    pub present: usize,
    pub level: i32,
}

fn invalid(message: String) -> Problem {
    Problem::Unsupported { message }
}

impl ShardValues<'_> {
    fn check(&self) -> Result<(Vec<usize>, usize), Problem> {
        let (shard, inner) = (self.shard, self.inner);
        if shard.is_empty() || shard.len() != inner.len() {
            return Err(invalid(format!(
                "shard shape {shard:?} and inner chunk shape {inner:?} must have one length >= 1"
            )));
        }
        if inner.iter().zip(shard).any(|(&c, &s)| c == 0 || s % c != 0) {
            return Err(invalid(format!(
                "inner chunk shape {inner:?} must divide the shard shape {shard:?}"
            )));
        }
        let values = shard
            .iter()
            .try_fold(self.itemsize, |acc, &s| acc.checked_mul(s));
        if self.itemsize == 0 || values != Some(self.data.len()) {
            return Err(invalid(format!(
                "{} bytes given for a shard of shape {shard:?} with {}-byte values",
                self.data.len(),
                self.itemsize
            )));
        }
        let grid: Vec<usize> = shard.iter().zip(inner).map(|(&s, &c)| s / c).collect();
        Ok((grid.clone(), grid.iter().product()))
    }

    /// The values of inner chunk `coords` (of the inner grid), C order.
    fn gather(&self, coords: &[usize], out: &mut Vec<u8>) {
        let (shard, inner, size) = (self.shard, self.inner, self.itemsize);
        let nd = shard.len();
        // Bytes between consecutive indices of each axis of the shard.
        let mut strides = vec![size; nd];
        for a in (0..nd - 1).rev() {
            strides[a] = strides[a + 1] * shard[a + 1];
        }
        let run = inner[nd - 1] * size; // a contiguous run along the last axis
        let start: usize = (0..nd).map(|a| coords[a] * inner[a] * strides[a]).sum();
        let rows: usize = inner[..nd - 1].iter().product();
        out.clear();
        let mut index = vec![0usize; nd - 1];
        for _ in 0..rows {
            let at = start
                + index
                    .iter()
                    .enumerate()
                    .map(|(a, &i)| i * strides[a])
                    .sum::<usize>();
            out.extend_from_slice(&self.data[at..at + run]);
            for a in (0..nd - 1).rev() {
                index[a] += 1;
                if index[a] < inner[a] {
                    break;
                }
                index[a] = 0;
            }
        }
    }
}

/// Coordinates of inner chunk `linear` (C order) of `grid`.
fn unravel(mut linear: usize, grid: &[usize]) -> Vec<usize> {
    let mut coords = vec![0; grid.len()];
    for a in (0..grid.len()).rev() {
        coords[a] = linear % grid[a];
        linear /= grid[a];
    }
    coords
}

/// Encode one shard whole (inner chunks in parallel, in kvcouple's pool).
pub fn encode_shard(v: &ShardValues) -> Result<Vec<u8>, Problem> {
    let (grid, count) = v.check()?;
    let encoded: Vec<Result<Option<Vec<u8>>, Problem>> = parallel::install(|| {
        (0..count)
            .into_par_iter()
            .map_init(Vec::new, |scratch, linear| {
                let coords = unravel(linear, &grid);
                if coords[0] * v.inner[0] >= v.present {
                    return Ok(None); // outside the array: not stored
                }
                v.gather(&coords, scratch);
                let mut out =
                    zstd::bulk::compress(scratch, v.level).map_err(|e| Problem::Decode {
                        key: format!("inner chunk {linear}"),
                        message: format!("zstd: {e}"),
                    })?;
                out.extend_from_slice(&crc32c::crc32c(&out).to_le_bytes());
                Ok(Some(out))
            })
            .collect()
    });
    let body: usize = encoded
        .iter()
        .map(|e| e.as_ref().map_or(0, |c| c.as_ref().map_or(0, Vec::len)))
        .sum();
    let mut shard = Vec::with_capacity(body + 16 * count + 4);
    let mut index = Vec::with_capacity(16 * count);
    for chunk in encoded {
        match chunk? {
            Some(bytes) => {
                index.extend_from_slice(&(shard.len() as u64).to_le_bytes());
                index.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
                shard.extend_from_slice(&bytes);
            }
            None => index.extend_from_slice(&[0xff; 16]),
        }
    }
    let checksum = crc32c::crc32c(&index);
    shard.extend_from_slice(&index);
    shard.extend_from_slice(&checksum.to_le_bytes());
    Ok(shard)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(values: &[i32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// Inner chunk `i` of an encoded shard, decompressed (checksums verified).
    fn inner_chunk(shard: &[u8], count: usize, i: usize) -> Option<Vec<u8>> {
        let index = &shard[shard.len() - 4 - 16 * count..shard.len() - 4];
        let crc = u32::from_le_bytes(shard[shard.len() - 4..].try_into().unwrap());
        assert_eq!(crc32c::crc32c(index), crc);
        let field = |j: usize| u64::from_le_bytes(index[8 * j..8 * j + 8].try_into().unwrap());
        let (offset, size) = (field(2 * i), field(2 * i + 1));
        if offset == u64::MAX {
            return None;
        }
        let stored = &shard[offset as usize..(offset + size) as usize];
        let (body, tail) = stored.split_at(stored.len() - 4);
        assert_eq!(crc32c::crc32c(body).to_le_bytes(), tail);
        Some(zstd::stream::decode_all(body).unwrap())
    }

    /// Encode `values` (i32) as a shard of shape `shard` with inner chunks `inner`.
    fn encoded(values: &[i32], shard: &[usize], inner: &[usize], present: usize) -> Vec<u8> {
        let data = ints(values);
        let v = ShardValues {
            data: &data,
            itemsize: 4,
            shard,
            inner,
            present,
            level: 1,
        };
        encode_shard(&v).unwrap()
    }

    #[test]
    fn inner_chunks_hold_their_blocks_in_c_order() {
        // A shard of shape (3, 2, 4) of i32, inner chunks (1, 1, 4): six chunks, the last
        // document (rows 2) outside the array.
        let values: Vec<i32> = (0..24).collect();
        let shard = encoded(&values, &[3, 2, 4], &[1, 1, 4], 2);
        for i in 0..4 {
            let want = ints(&values[4 * i..4 * i + 4]);
            assert_eq!(inner_chunk(&shard, 6, i), Some(want), "chunk {i}");
        }
        assert_eq!(inner_chunk(&shard, 6, 4), None);
        assert_eq!(inner_chunk(&shard, 6, 5), None);
    }

    #[test]
    fn inner_chunks_split_inner_axes() {
        // Shape (2, 4), inner (1, 2): chunk (1, 1) holds values [6, 7].
        let values: Vec<i32> = (0..8).collect();
        let shard = encoded(&values, &[2, 4], &[1, 2], 2);
        assert_eq!(inner_chunk(&shard, 4, 3), Some(ints(&[6, 7])));
        assert_eq!(inner_chunk(&shard, 4, 1), Some(ints(&[2, 3])));
    }

    #[test]
    fn bad_shapes_are_refused_not_panicked() {
        let data = ints(&[1, 2, 3]);
        for (shard, inner) in [(&[4usize][..], &[1usize][..]), (&[3], &[2]), (&[3], &[0])] {
            let v = ShardValues {
                data: &data,
                itemsize: 4,
                shard,
                inner,
                present: 3,
                level: 1,
            };
            assert!(encode_shard(&v).is_err(), "{shard:?} {inner:?}");
        }
    }
}
