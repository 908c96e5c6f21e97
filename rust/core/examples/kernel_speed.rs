//! Single-threaded ns per vocabulary entry of the divergence pass (a profiling aid).
//! `cargo run --release --example kernel_speed`
use kvcouple_core::divergence::{divergences, plain_pass, Options};
use kvcouple_core::parallel::set_num_threads;
use kvcouple_core::rows::Rows;
use std::time::Instant;

fn main() {
    set_num_threads(1).unwrap();
    let (rows, vocab) = (8, 128_256);
    let mut state = 1u64;
    let mut p: Vec<f32> = (0..rows * vocab)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((state >> 40) as f32 + 1.0) / (1u64 << 24) as f32
        })
        .collect();
    for r in 0..rows {
        let s: f32 = p[r * vocab..(r + 1) * vocab].iter().sum();
        p[r * vocab..(r + 1) * vocab]
            .iter_mut()
            .for_each(|x| *x /= s);
    }
    let q: Vec<f32> = p.iter().rev().copied().collect();
    let n = (rows * vocab) as f64;
    let (mut best, mut best_plain) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..20 {
        let t = Instant::now();
        let d = divergences(
            Rows::F32(&p),
            Rows::F32(&q),
            rows,
            vocab,
            &Options::default(),
        )
        .unwrap();
        let dt = t.elapsed().as_secs_f64();
        let t2 = Instant::now();
        let s = plain_pass(Rows::F32(&p), Rows::F32(&q), rows, vocab).unwrap();
        let dt2 = t2.elapsed().as_secs_f64();
        assert!(d[0].tv > 0.0 && s[0] > 0.0);
        best = best.min(dt / n * 1e9);
        best_plain = best_plain.min(dt2 / n * 1e9);
    }
    // Minimum over runs: the least disturbed by other load on the machine.
    println!("divergences {best:.2} ns/entry, plain pass {best_plain:.2} ns/entry (one thread)");
}
