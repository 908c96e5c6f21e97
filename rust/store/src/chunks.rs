//! Whole chunks of the small variables (hazards, tokens, lengths, ...), decoded as they are
//! stored: one call reads a document's chunk of every variable at once, in parallel, from a
//! [`ChunkSource`] (a local store's files or fetched objects), with the checks of the
//! distributions' path (an absent chunk named, crc32c verified, the decoded size exact). The
//! caller views the bytes with the variable's dtype.
//!
//! Only the layout kvcouple writes is read here ([`crate::direct`]: `bytes` -> `zstd`
//! (-> `crc32c`), little endian), as chunk objects or as the inner chunks of shards
//! (`sharding_indexed`, its index `bytes` (-> `crc32c`)); anything else is
//! [`Problem::Unsupported`]. A shard is read once per call however many of its inner chunks
//! are asked for, and its index verified; a problem inside it names the shard's key and the
//! inner chunk.

use std::collections::HashMap;

use rayon::prelude::*;
use zarrs::metadata::ArrayMetadata;

use kvcouple_core::parallel;

use crate::direct::{self, Layout, Sharded};
use crate::source::ChunkSource;
use crate::Problem;

/// One chunk to decode: its key (relative to the store's root), its variable's metadata
/// document (`zarr.json` or `.zarray`, as stored) and, where the variable is sharded, the
/// inner chunk's linear (C-order) index within its shard (`key` is then the shard's).
pub struct Chunk<'a> {
    pub key: &'a str,
    pub meta: &'a str,
    pub inner: Option<u64>,
}

/// A variable's direct layout: whole chunk objects, or inner chunks of shards.
#[derive(Clone)]
enum Stored {
    Chunks(Layout),
    Shards(Sharded),
}

/// The variable's layout, or unsupported.
fn layout_of(key: &str, meta: &str) -> Result<Stored, Problem> {
    let unsupported = |why: String| Problem::Unsupported {
        message: format!("chunk {key}: {why}"),
    };
    let parsed: ArrayMetadata =
        serde_json::from_str(meta).map_err(|e| unsupported(e.to_string()))?;
    direct::layout_any(&parsed)
        .map(Stored::Chunks)
        .or_else(|| direct::sharded_any(&parsed).map(Stored::Shards))
        .ok_or_else(|| {
            unsupported(
                "not one zstd(+crc32c) chunk of fixed-size values, nor shards of such chunks"
                    .into(),
            )
        })
}

/// Every chunk's decoded bytes, in order; the first problem (in chunk order) otherwise.
pub fn decode_chunks(source: &dyn ChunkSource, chunks: &[Chunk]) -> Result<Vec<Vec<u8>>, Problem> {
    decode_runs(source, chunks, &vec![1; chunks.len()])
}

/// The chunks' decoded bytes in runs of consecutive chunks, `runs[r]` chunks in run r (the
/// lengths sum to the number of chunks): each run's chunks one after another, each decoded
/// straight into its place (a batch of documents' chunks of a variable: one buffer, no
/// per-chunk copies); the first problem (in chunk order) otherwise.
pub fn decode_runs(
    source: &dyn ChunkSource,
    chunks: &[Chunk],
    runs: &[usize],
) -> Result<Vec<Vec<u8>>, Problem> {
    if runs.iter().sum::<usize>() != chunks.len() {
        return Err(Problem::Unsupported {
            message: format!(
                "runs of {} chunks in all for {} chunks",
                runs.iter().sum::<usize>(),
                chunks.len()
            ),
        });
    }
    let (groups, sizes) = by_object(chunks)?;
    // Zeroed runs: large ones come from the allocator as fresh zero pages, not written twice.
    let mut run_sizes: Vec<&[usize]> = Vec::with_capacity(runs.len());
    let mut rest = sizes.as_slice();
    for &len in runs {
        let (run, tail) = rest.split_at(len);
        run_sizes.push(run);
        rest = tail;
    }
    let mut out: Vec<Vec<u8>> = run_sizes
        .iter()
        .map(|run| vec![0u8; run.iter().sum()])
        .collect();
    let mut slots: Vec<Option<&mut [u8]>> = Vec::with_capacity(chunks.len());
    for (run, &run_sizes) in out.iter_mut().zip(&run_sizes) {
        let mut rest = run.as_mut_slice();
        for &size in run_sizes {
            let (slot, tail) = rest.split_at_mut(size);
            slots.push(Some(slot));
            rest = tail;
        }
    }
    let work: Vec<(&Stored, &[usize], Vec<&mut [u8]>)> = groups
        .iter()
        .map(|(stored, members)| {
            let outs = members.iter().filter_map(|&i| slots[i].take()).collect();
            (stored, members.as_slice(), outs)
        })
        .collect();
    let results: Vec<Vec<Result<(), Problem>>> = parallel::install(|| {
        work.into_par_iter()
            .map(|(stored, members, outs)| decode_group(source, chunks, stored, members, outs))
            .collect()
    });
    let mut first: Option<(usize, Problem)> = None;
    for ((_, members), results) in groups.iter().zip(results) {
        for (&i, result) in members.iter().zip(results) {
            if let Err(problem) = result {
                if first.as_ref().is_none_or(|(j, _)| i < *j) {
                    first = Some((i, problem));
                }
            }
        }
    }
    match first {
        Some((_, problem)) => Err(problem),
        None => Ok(out),
    }
}

/// The chunks by stored object (a shard's inner chunks are decoded from one read of it), and
/// each chunk's decoded size; unsupported layouts and inner indices refused.
#[allow(clippy::type_complexity)]
fn by_object(chunks: &[Chunk]) -> Result<(Vec<(Stored, Vec<usize>)>, Vec<usize>), Problem> {
    // A call holds many documents' chunks of a few variables: each metadata document is
    // parsed once, and hashed only where the chunks move to another variable's (the same
    // document given again is the same slice: a metadata document is kilobytes, hashing it
    // for every chunk cost more than a fifth of a summary store's read).
    let mut layouts: Vec<Stored> = Vec::new();
    let mut layout_of_meta: HashMap<&str, usize> = HashMap::new();
    let mut last: Option<(&str, usize)> = None;
    let mut groups: Vec<(Stored, Vec<usize>)> = Vec::new();
    let mut group_of: HashMap<(&str, usize), usize> = HashMap::new();
    let mut sizes = Vec::with_capacity(chunks.len());
    for (i, c) in chunks.iter().enumerate() {
        let m = match last {
            Some((meta, m)) if std::ptr::eq(meta, c.meta) => m,
            _ => match layout_of_meta.get(c.meta) {
                Some(&m) => m,
                None => {
                    layouts.push(layout_of(c.key, c.meta)?);
                    layout_of_meta.insert(c.meta, layouts.len() - 1);
                    layouts.len() - 1
                }
            },
        };
        last = Some((c.meta, m));
        let stored = &layouts[m];
        match (stored, c.inner) {
            (Stored::Chunks(_), None) => {}
            (Stored::Shards(s), Some(inner)) if inner < s.per_shard => {}
            (Stored::Chunks(_), Some(inner)) => {
                return Err(Problem::Unsupported {
                    message: format!(
                        "chunk {}: inner chunk {inner} asked of an array that is not sharded",
                        c.key
                    ),
                })
            }
            (Stored::Shards(s), inner) => {
                return Err(Problem::Unsupported {
                    message: format!(
                        "chunk {}: a sharded array's chunk needs its inner chunk's index \
                         (< {}), not {inner:?}",
                        c.key, s.per_shard
                    ),
                })
            }
        }
        sizes.push(decoded_bytes(stored));
        let g = *group_of.entry((c.key, m)).or_insert_with(|| {
            groups.push((stored.clone(), Vec::new()));
            groups.len() - 1
        });
        groups[g].1.push(i);
    }
    Ok((groups, sizes))
}

/// The bytes of one decoded chunk of a variable stored so.
fn decoded_bytes(stored: &Stored) -> usize {
    match stored {
        Stored::Chunks(layout) => layout.chunk.iter().product::<u64>() as usize * layout.itemsize,
        Stored::Shards(shard) => shard.inner_bytes,
    }
}

/// The chunks `members` of `chunks`, all of one object, decoded into `outs` (one slot each,
/// of its decoded size); each chunk's problem.
fn decode_group(
    source: &dyn ChunkSource,
    chunks: &[Chunk],
    stored: &Stored,
    members: &[usize],
    mut outs: Vec<&mut [u8]>,
) -> Vec<Result<(), Problem>> {
    let key = chunks[members[0]].key;
    let want = decoded_bytes(stored);
    let mut buffers = direct::take();
    let out = match stored {
        Stored::Chunks(layout) => match buffers.decode(source, key, want, layout.crc32c) {
            Ok(()) => {
                let bytes = &bytemuck::cast_slice::<u64, u8>(&buffers.decoded)[..want];
                for out in outs.iter_mut() {
                    out.copy_from_slice(bytes);
                }
                vec![Ok(()); members.len()]
            }
            Err(problem) => vec![Err(problem); members.len()],
        },
        Stored::Shards(shard) => {
            let inners: Vec<u64> = members
                .iter()
                .map(|&i| {
                    chunks[i]
                        .inner
                        .expect("checked: a sharded chunk has its index")
                })
                .collect();
            buffers
                .decode_shard(source, key, shard, &inners, |j, bytes| {
                    outs[j].copy_from_slice(bytes)
                })
                .unwrap_or_else(|whole| vec![Err(whole); members.len()])
        }
    };
    direct::give(buffers);
    out
}

#[cfg(test)]
mod tests;
