//! The full-record floor's structure, on one core: a store's first chunk pairs of `p` and `q`
//! decoded (zstd), then decoded with every row's TV, then decoded with every row's checked TV
//! and top-token delta (what the engine's recomputation does), then decoded a row at a time
//! through zstd's streaming API with each row's TV taken at once. Prints each pass's seconds,
//! best of 3, taking turns.
//!
//!     cargo run --release -p kvcouple-store --example decode_tv -- STORE [CHUNKS]
//!
//! STORE: a full-record store of float16 rows with one chunk per document on the first axis
//! and Zarr v3 `bytes -> zstd -> crc32c` (`benchmarks/make_synthetic_store.py` writes them).

use std::path::Path;
use std::time::Instant;

use kvcouple_core::half::{tv_and_sums_f16, tv_f16};
use kvcouple_core::row_top::top_delta_one;
use kvcouple_core::rows::Rows;
use serde_json::Value;
use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};

type Pair = (Vec<u8>, Vec<u8>);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let store = args.next().ok_or("usage: decode_tv STORE [CHUNKS]")?;
    let chunks: usize = args.next().map_or(Ok(12), |s| s.parse())?;
    let meta: Value =
        serde_json::from_slice(&std::fs::read(Path::new(&store).join("p/zarr.json"))?)?;
    let shape: Vec<usize> = meta["chunk_grid"]["configuration"]["chunk_shape"]
        .as_array()
        .ok_or("p/zarr.json: no regular chunk grid")?
        .iter()
        .map(|v| {
            v.as_u64()
                .map(|x| x as usize)
                .ok_or("a chunk length that is not a count")
        })
        .collect::<Result<_, _>>()?;
    if meta["data_type"] != "float16" || shape[0] != 1 {
        return Err("p must be float16 rows, one document per chunk".into());
    }
    let vocab = *shape.last().ok_or("p has no axes")?;
    let rows: usize = shape.iter().product::<usize>() / vocab;
    let rest = ".0".repeat(shape.len() - 1);
    let pairs: Vec<Pair> = (0..chunks)
        .map(|d| -> Result<Pair, Box<dyn std::error::Error>> {
            let read = |v: &str| std::fs::read(Path::new(&store).join(format!("{v}/{d}{rest}")));
            let (p, q) = (read("p")?, read("q")?);
            // The crc32c's 4 bytes follow the zstd frame.
            Ok((p[..p.len() - 4].to_vec(), q[..q.len() - 4].to_vec()))
        })
        .collect::<Result<_, _>>()?;
    let values = rows * vocab;
    let (mut pb, mut qb) = (vec![0u16; values], vec![0u16; values]);
    let mut dz = zstd::bulk::Decompressor::new()?;
    let mut decode = |p: &[u8], q: &[u8], pb: &mut [u16], qb: &mut [u16]| {
        dz.decompress_to_buffer(p, bytes(pb)).expect("zstd");
        dz.decompress_to_buffer(q, bytes(qb)).expect("zstd");
    };
    let mut best = [f64::INFINITY; 4];
    let mut sums = [0.0f64; 4];
    for _ in 0..3 {
        let t = Instant::now();
        for (p, q) in &pairs {
            decode(p, q, &mut pb, &mut qb);
        }
        best[0] = best[0].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for (p, q) in &pairs {
            decode(p, q, &mut pb, &mut qb);
            for r in 0..rows {
                sums[1] += tv_f16(
                    &pb[r * vocab..(r + 1) * vocab],
                    &qb[r * vocab..(r + 1) * vocab],
                );
            }
        }
        best[1] = best[1].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for (p, q) in &pairs {
            decode(p, q, &mut pb, &mut qb);
            for r in 0..rows {
                let row = r * vocab..(r + 1) * vocab;
                let (tv, _, _, _) = tv_and_sums_f16(&pb[row.clone()], &qb[row]);
                let top = top_delta_one(&Rows::F16(&pb), &Rows::F16(&qb), r * vocab, vocab);
                sums[2] += tv + 0.0 * top;
            }
        }
        best[2] = best[2].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        sums[3] += streamed(&pairs, rows, vocab)?;
        best[3] = best[3].min(t.elapsed().as_secs_f64());
    }
    if (sums[1] - sums[3]).abs() > 1e-9 * sums[1].abs() {
        return Err(format!(
            "the streamed TVs sum to {}, the decoded ones {}",
            sums[3], sums[1]
        )
        .into());
    }
    let gb = (2 * values * 2 * chunks) as f64 / 1e9;
    println!(
        "{chunks} chunk pairs of {rows} rows x {vocab} (float16), {gb:.2} GB decoded; best of 3:"
    );
    for (name, s) in [
        "decode",
        "decode + TV",
        "decode + checked TV + top delta",
        "streamed rows + TV",
    ]
    .iter()
    .zip(best)
    {
        println!("  {name:32} {s:.3} s ({:.2}x the decode)", s / best[0]);
    }
    Ok(())
}

/// Every pair decoded a row at a time through zstd's streaming API, each row's TV taken while
/// it is in cache: the sum of the TVs.
fn streamed(pairs: &[Pair], rows: usize, vocab: usize) -> Result<f64, Box<dyn std::error::Error>> {
    let (mut pr, mut qr) = (vec![0u16; vocab], vec![0u16; vocab]);
    let (mut dp, mut dq) = (Decoder::new()?, Decoder::new()?);
    let mut sum = 0.0;
    for (p, q) in pairs {
        dp.reinit()?;
        dq.reinit()?;
        let (mut ip, mut iq) = (InBuffer::around(p), InBuffer::around(q));
        for _ in 0..rows {
            for (d, input, row) in [(&mut dp, &mut ip, &mut pr), (&mut dq, &mut iq, &mut qr)] {
                let mut out = OutBuffer::around(bytes(row));
                while out.pos() < out.capacity() {
                    if d.run(input, &mut out)? == 0 && out.pos() < out.capacity() {
                        return Err("a frame ended before its rows".into());
                    }
                }
            }
            sum += tv_f16(&pr, &qr);
        }
    }
    Ok(sum)
}

fn bytes(v: &mut [u16]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}
