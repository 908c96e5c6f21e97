//! Which float16 widening the portable kernels use (`half::f16_to_f32`): a 65536-entry table
//! or integer operations. Both are exact for every half (they are compared bit for bit below);
//! this times them single-threaded in the two loops that widen without F16C (aarch64, or an x86
//! CPU without it): widening a run into f64 (`Rows::load`) and the f32-lane TV of `row_tv`.
//! The halves are what a softmax over a 128k vocabulary stores: mostly subnormals.
//! `cargo run --release --example f16_widening`
use std::hint::black_box;
use std::time::Instant;

/// The table: all 65536 halves as f32, filled once by arithmetic (multiplying by 2^112).
fn table() -> &'static [f32; 65536] {
    static TABLE: std::sync::OnceLock<Box<[f32; 65536]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([0f32; 65536]);
        for (h, v) in t.iter_mut().enumerate() {
            let mag = f32::from_bits(((h as u32) & 0x7fff) << 13) as f64 * 2f64.powi(112);
            *v = if h & 0x8000 != 0 { -mag } else { mag } as f32;
        }
        t
    })
}

/// Integer operations: rebias a normal half, scale a subnormal's integer mantissa by 2^-24.
#[inline(always)]
fn integer(h: u16) -> f32 {
    let h = h as u32;
    let mag = h & 0x7fff;
    let normal = f32::from_bits((mag << 13) + 0x3800_0000);
    let sub = (mag & 0x03ff) as f32 * f32::from_bits(0x3380_0000);
    let v = if mag < 0x0400 { sub } else { normal };
    f32::from_bits(v.to_bits() | ((h & 0x8000) << 16))
}

#[inline(always)]
fn widen(src: &[u16], out: &mut [f64], f: impl Fn(u16) -> f32) {
    for (o, &h) in out.iter_mut().zip(src) {
        *o = f(h) as f64;
    }
}

#[inline(always)]
fn tv(a: &[u16], b: &[u16], f: impl Fn(u16) -> f32) -> f64 {
    let mut total = 0.0f64;
    for (ba, bb) in a.chunks(1024).zip(b.chunks(1024)) {
        let mut lanes = [0.0f32; 16];
        for (ca, cb) in ba.chunks_exact(16).zip(bb.chunks_exact(16)) {
            for j in 0..16 {
                lanes[j] += (f(ca[j]) - f(cb[j])).abs();
            }
        }
        total += lanes.iter().map(|&x| x as f64).sum::<f64>();
    }
    0.5 * total
}

fn best_ns(n: usize, mut run: impl FnMut()) -> f64 {
    (0..30)
        .map(|_| {
            let t = Instant::now();
            run();
            t.elapsed().as_secs_f64() / n as f64 * 1e9
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    for h in 0..=u16::MAX {
        assert_eq!(
            table()[h as usize].to_bits(),
            integer(h).to_bits(),
            "{h:#x}"
        );
    }
    let n = 8 * 128 * 1024;
    let mut state = 1u64;
    let mut half = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
        let r = (state >> 33) as u16;
        // 9 in 10 subnormal, the rest normal below 1.
        if r < 6554 {
            0x0400 + r % 0x3800
        } else {
            r % 0x0400
        }
    };
    let a: Vec<u16> = (0..n).map(|_| half()).collect();
    let b: Vec<u16> = (0..n).map(|_| half()).collect();
    let mut out = vec![0.0f64; n];
    let t = table();
    let widen_table = best_ns(n, || {
        widen(black_box(&a), &mut out, |h| t[h as usize]);
        black_box(&mut out);
    });
    let widen_int = best_ns(n, || {
        widen(black_box(&a), &mut out, integer);
        black_box(&mut out);
    });
    let tv_table = best_ns(n, || {
        black_box(tv(black_box(&a), &b, |h| t[h as usize]));
    });
    let tv_int = best_ns(n, || {
        black_box(tv(black_box(&a), &b, integer));
    });
    println!("widen to f64: table {widen_table:.3} ns/half, integer {widen_int:.3} ns/half");
    println!("row TV (both rows): table {tv_table:.3} ns/entry, integer {tv_int:.3} ns/entry");
}
