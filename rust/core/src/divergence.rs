//! Per-row divergences between two next-token distributions, in one pass over the vocabulary.
//!
//! Conventions (also in the Python docstring):
//! - logarithms are natural (nats); `0 ln 0 = 0`;
//! - `kl_pq = +inf` when some `p > 0` has `q = 0` (and `kl_qp` symmetrically);
//! - rows must sum to 1 within `atol` (default by dtype) unless `renormalize`, which divides
//!   each row by its own sum;
//! - `hellinger = sqrt(1/2 sum (sqrt p - sqrt q)^2)`, `js` uses `m = (p + q) / 2`;
//! - `top1_agree` compares first-index argmaxes.
//!
//! Sums are two-level (8 lanes within 1024-element blocks, then blocks), all in f64.

use rayon::prelude::*;
use std::cell::RefCell;

use crate::error::{KvError, KvResult};
use crate::fastmath::{ln3_and_quotient, positive_or_tiny};
use crate::parallel;
use crate::rows::{check_pair, Dtype, Rows};
use crate::simd::{self, Level};
use crate::transform::Transform;

pub(crate) const BLOCK: usize = 1024;
const LANES: usize = 8;

/// Options of [`divergences`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Inputs are logits: apply this decoding transform to both before comparing.
    pub logits: Option<Transform>,
    /// Divide each row by its sum instead of rejecting rows that do not sum to 1.
    pub renormalize: bool,
    /// Tolerance on `|sum - 1|`; `None` picks [`default_atol`] for the input dtype.
    pub atol: Option<f64>,
}

/// The default tolerance on row sums: half formats lose tiny probabilities to underflow.
pub fn default_atol(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F16 | Dtype::BF16 => 1e-2,
        Dtype::F32 => 1e-4,
        Dtype::F64 => 1e-6,
    }
}

/// Divergences of one row pair.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowDivergence {
    pub tv: f64,
    pub kl_pq: f64,
    pub kl_qp: f64,
    pub js: f64,
    pub hellinger: f64,
    pub entropy_p: f64,
    pub entropy_q: f64,
    pub overlap: f64,
    pub top1_agree: bool,
}

/// Raw sums over one row (after optional scaling).
#[derive(Debug, Default, Clone, Copy)]
struct RowSums {
    pp: f64,
    pq: f64,
    qq: f64,
    qp: f64,
    mm: f64,
    abs_diff: f64,
    hel: f64,
    sp: f64,
    sq: f64,
    inf_pq: f64,
    inf_qp: f64,
    min: f64,
    argmax_p: usize,
    argmax_q: usize,
}

#[derive(Clone, Copy)]
struct Lanes {
    pp: [f64; LANES],
    pq: [f64; LANES],
    qq: [f64; LANES],
    qp: [f64; LANES],
    mm: [f64; LANES],
    abs_diff: [f64; LANES],
    hel: [f64; LANES],
    sp: [f64; LANES],
    sq: [f64; LANES],
    inf_pq: [f64; LANES],
    inf_qp: [f64; LANES],
    min: [f64; LANES],
    max_p: [f64; LANES],
    max_q: [f64; LANES],
}

impl Lanes {
    fn zero() -> Self {
        let z = [0.0; LANES];
        Lanes {
            pp: z,
            pq: z,
            qq: z,
            qp: z,
            mm: z,
            abs_diff: z,
            hel: z,
            sp: z,
            sq: z,
            inf_pq: z,
            inf_qp: z,
            min: [f64::INFINITY; LANES],
            max_p: [f64::NEG_INFINITY; LANES],
            max_q: [f64::NEG_INFINITY; LANES],
        }
    }
}

/// Every sum over the first `groups` lane groups of a block (the caller zero-pads a partial
/// last group: zeros add nothing to any sum, and a minimum of 0 only where a row is short).
/// Kept apart from the row loop and over fixed-size arrays so that it vectorises; compiled for
/// each [`simd::Level`], picked at run time. Only the groups holding values are summed: a
/// short row (a synthetic pair's vocabulary of 5) costs its length, not a block's 1024.
/// The Hellinger term uses `(sqrt p - sqrt q)^2 = (p - q)^2 / (p + q + 2 sqrt(pq))`: one
/// square root, no cancellation, exactly 0 for equal entries.
#[inline(always)]
fn block_kernel(a: &[f64; BLOCK], b: &[f64; BLOCK], groups: usize, l: &mut Lanes) {
    for c in 0..groups.min(BLOCK / LANES) {
        for j in 0..LANES {
            let i = c * LANES + j;
            let (p, q) = (a[i], b[i]);
            let m = 0.5 * (p + q);
            let diff = p - q;
            let den_h = (p + q + 2.0 * (p * q).max(0.0).sqrt()).max(1e-150);
            let (lp, lq, lm, hel) = ln3_and_quotient(
                positive_or_tiny(p),
                positive_or_tiny(q),
                positive_or_tiny(m),
                diff * diff,
                den_h,
            );
            l.pp[j] += p * lp;
            l.pq[j] += p * lq;
            l.qq[j] += q * lq;
            l.qp[j] += q * lp;
            l.mm[j] += m * lm;
            l.abs_diff[j] += diff.abs();
            l.hel[j] += hel;
            l.sp[j] += p;
            l.sq[j] += q;
            l.inf_pq[j] += if p > 0.0 && q == 0.0 { 1.0 } else { 0.0 };
            l.inf_qp[j] += if q > 0.0 && p == 0.0 { 1.0 } else { 0.0 };
            l.min[j] = l.min[j].min(p.min(q));
            l.max_p[j] = l.max_p[j].max(p);
            l.max_q[j] = l.max_q[j].max(q);
        }
    }
}

fn block_kernel_generic(a: &[f64; BLOCK], b: &[f64; BLOCK], groups: usize, l: &mut Lanes) {
    block_kernel(a, b, groups, l)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_kernel_avx2(a: &[f64; BLOCK], b: &[f64; BLOCK], groups: usize, l: &mut Lanes) {
    block_kernel(a, b, groups, l)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
unsafe fn block_kernel_avx512(a: &[f64; BLOCK], b: &[f64; BLOCK], groups: usize, l: &mut Lanes) {
    block_kernel(a, b, groups, l)
}

type BlockKernel = fn(&[f64; BLOCK], &[f64; BLOCK], usize, &mut Lanes);

/// The block kernel for this CPU's [`simd::level`]. Every variant sums in the same lane
/// order, so results are bit-identical across CPUs.
fn pick_block_kernel() -> BlockKernel {
    match simd::level() {
        // SAFETY: only reached when the CPU has the features the kernel was compiled for.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => |a, b, g, l| unsafe { block_kernel_avx512(a, b, g, l) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => |a, b, g, l| unsafe { block_kernel_avx2(a, b, g, l) },
        _ => block_kernel_generic,
    }
}

fn fold(x: &[f64; LANES]) -> f64 {
    ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))
}

#[inline(always)]
fn argmax_into(buf: &[f64], base: usize, best: &mut f64, idx: &mut usize) {
    for (i, &v) in buf.iter().enumerate() {
        if v > *best {
            *best = v;
            *idx = base + i;
        }
    }
}

/// Source of one row's values, block by block.
enum RowSource<'a> {
    Stored { rows: Rows<'a>, offset: usize },
    Dense(&'a [f64]),
}

impl RowSource<'_> {
    #[inline(always)]
    fn load(&self, start: usize, out: &mut [f64]) -> bool {
        match self {
            RowSource::Stored { rows, offset } => rows.load(offset + start, out),
            RowSource::Dense(v) => {
                out.copy_from_slice(&v[start..start + out.len()]);
                false
            }
        }
    }
}

fn row_sums(
    p: &RowSource,
    q: &RowSource,
    vocab: usize,
    scale_p: f64,
    scale_q: f64,
) -> (RowSums, bool) {
    thread_local! {
        // A row's block buffers, reused: zeroing two fresh 8 KiB arrays per row cost more
        // than a short row's sums. The kernel reads only the groups written below.
        static BUFFERS: RefCell<Box<([f64; BLOCK], [f64; BLOCK])>> =
            RefCell::new(Box::new(([0.0; BLOCK], [0.0; BLOCK])));
    }
    BUFFERS.with(|buffers| {
        let (a, b) = &mut **buffers.borrow_mut();
        row_sums_in(p, q, vocab, scale_p, scale_q, a, b)
    })
}

fn row_sums_in(
    p: &RowSource,
    q: &RowSource,
    vocab: usize,
    scale_p: f64,
    scale_q: f64,
    a: &mut [f64; BLOCK],
    b: &mut [f64; BLOCK],
) -> (RowSums, bool) {
    static KERNEL: std::sync::OnceLock<BlockKernel> = std::sync::OnceLock::new();
    let kernel = *KERNEL.get_or_init(pick_block_kernel);
    let mut s = RowSums {
        min: f64::INFINITY,
        ..Default::default()
    };
    let (mut best_p, mut best_q) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    let mut nonfinite = false;
    let mut start = 0;
    while start < vocab {
        let n = BLOCK.min(vocab - start);
        nonfinite |= p.load(start, &mut a[..n]);
        nonfinite |= q.load(start, &mut b[..n]);
        let groups = n.div_ceil(LANES);
        a[n..groups * LANES].fill(0.0);
        b[n..groups * LANES].fill(0.0);
        if scale_p != 1.0 || scale_q != 1.0 {
            a[..n].iter_mut().for_each(|x| *x *= scale_p);
            b[..n].iter_mut().for_each(|x| *x *= scale_q);
        }
        let mut l = Lanes::zero();
        kernel(a, b, groups, &mut l);
        s.pp += fold(&l.pp);
        s.pq += fold(&l.pq);
        s.qq += fold(&l.qq);
        s.qp += fold(&l.qp);
        s.mm += fold(&l.mm);
        s.abs_diff += fold(&l.abs_diff);
        s.hel += fold(&l.hel);
        s.sp += fold(&l.sp);
        s.sq += fold(&l.sq);
        s.inf_pq += fold(&l.inf_pq);
        s.inf_qp += fold(&l.inf_qp);
        s.min = l.min.iter().copied().fold(s.min, f64::min);
        // Scan for the first index of a new maximum only in blocks that hold one (rare).
        if l.max_p.iter().copied().fold(f64::NEG_INFINITY, f64::max) > best_p {
            argmax_into(&a[..n], start, &mut best_p, &mut s.argmax_p);
        }
        if l.max_q.iter().copied().fold(f64::NEG_INFINITY, f64::max) > best_q {
            argmax_into(&b[..n], start, &mut best_q, &mut s.argmax_q);
        }
        start += n;
    }
    (s, nonfinite)
}

fn finish(s: &RowSums) -> RowDivergence {
    let tv = (0.5 * s.abs_diff).clamp(0.0, 1.0);
    let kl_pq = if s.inf_pq > 0.0 {
        f64::INFINITY
    } else {
        (s.pp - s.pq).max(0.0)
    };
    let kl_qp = if s.inf_qp > 0.0 {
        f64::INFINITY
    } else {
        (s.qq - s.qp).max(0.0)
    };
    RowDivergence {
        tv,
        kl_pq,
        kl_qp,
        js: (0.5 * (s.pp + s.qq) - s.mm).max(0.0),
        hellinger: (0.5 * s.hel).max(0.0).sqrt().min(1.0),
        entropy_p: (-s.pp).max(0.0),
        entropy_q: (-s.qq).max(0.0),
        overlap: 1.0 - tv,
        top1_agree: s.argmax_p == s.argmax_q,
    }
}

/// Validate sums and signs of one row; `what` names the side for messages.
fn check_row(row: usize, s: &RowSums, nonfinite: bool, atol: f64) -> KvResult<()> {
    if nonfinite {
        return Err(KvError::row(row, "contains NaN or infinity"));
    }
    if s.min < 0.0 {
        return Err(KvError::row(row, "contains a negative probability"));
    }
    for (side, sum) in [("p", s.sp), ("q", s.sq)] {
        if (sum - 1.0).abs() > atol {
            return Err(KvError::row(
                row,
                format!(
                    "{side} sums to {sum:.6}, not 1 within atol={atol} (pass renormalize=True to normalise rows)"
                ),
            ));
        }
    }
    Ok(())
}

/// Sum of one row, with validity checks, for renormalisation.
pub(crate) fn row_total(rows: &Rows, row: usize, vocab: usize) -> KvResult<f64> {
    // A short row is one block either way: a buffer of its size spares zeroing 8 KiB.
    if vocab <= 64 {
        row_total_in::<64>(rows, row, vocab)
    } else {
        row_total_in::<BLOCK>(rows, row, vocab)
    }
}

fn row_total_in<const N: usize>(rows: &Rows, row: usize, vocab: usize) -> KvResult<f64> {
    let mut buf = [0.0f64; N];
    let mut total = 0.0;
    let mut start = 0;
    while start < vocab {
        let n = N.min(vocab - start);
        if rows.load(row * vocab + start, &mut buf[..n]) {
            return Err(KvError::row(row, "contains NaN or infinity"));
        }
        for &x in &buf[..n] {
            if x < 0.0 {
                return Err(KvError::row(row, "contains a negative probability"));
            }
            total += x;
        }
        start += n;
    }
    if total <= 0.0 {
        return Err(KvError::row(
            row,
            "sums to 0: no probability mass to renormalise",
        ));
    }
    Ok(total)
}

fn one_row(
    p: &Rows,
    q: &Rows,
    row: usize,
    vocab: usize,
    opts: &Options,
) -> KvResult<RowDivergence> {
    let atol = opts.atol.unwrap_or_else(|| default_atol(p.dtype()));
    if let Some(t) = opts.logits {
        let mut a = vec![0.0; vocab];
        let mut b = vec![0.0; vocab];
        let mut scratch = Vec::new();
        for (side, rows, buf) in [("p", p, &mut a), ("q", q, &mut b)] {
            for (i, x) in buf.iter_mut().enumerate() {
                *x = rows.get(row * vocab + i);
            }
            if !t.apply(buf, &mut scratch) {
                return Err(KvError::row(
                    row,
                    format!("{side} logits contain NaN or +inf"),
                ));
            }
            if buf.iter().all(|&x| x == 0.0) {
                return Err(KvError::row(row, format!("{side} logits are all -inf")));
            }
        }
        let (s, _) = row_sums(
            &RowSource::Dense(&a),
            &RowSource::Dense(&b),
            vocab,
            1.0,
            1.0,
        );
        return Ok(finish(&s));
    }
    let src_p = RowSource::Stored {
        rows: *p,
        offset: row * vocab,
    };
    let src_q = RowSource::Stored {
        rows: *q,
        offset: row * vocab,
    };
    let (scale_p, scale_q) = if opts.renormalize {
        (
            1.0 / row_total(p, row, vocab)?,
            1.0 / row_total(q, row, vocab)?,
        )
    } else {
        (1.0, 1.0)
    };
    let (s, nonfinite) = row_sums(&src_p, &src_q, vocab, scale_p, scale_q);
    check_row(row, &s, nonfinite, atol)?;
    Ok(finish(&s))
}

/// Divergences of every row pair of two `rows x vocab` matrices, in parallel over rows.
/// Errors name the first offending row.
pub fn divergences(
    p: Rows,
    q: Rows,
    rows: usize,
    vocab: usize,
    opts: &Options,
) -> KvResult<Vec<RowDivergence>> {
    check_pair(&p, &q, rows, vocab)?;
    if let Some(t) = opts.logits {
        t.validate()?;
    }
    if let Some(a) = opts.atol {
        if a.is_nan() || a < 0.0 {
            return Err(KvError::InvalidArgument(format!(
                "atol must be >= 0, got {a}"
            )));
        }
    }
    let out: Vec<KvResult<RowDivergence>> = parallel::install(|| {
        (0..rows)
            .into_par_iter()
            .map(|r| one_row(&p, &q, r, vocab, opts))
            .collect()
    });
    out.into_iter().collect()
}

/// A plain streaming pass over the same bytes (convert and sum both rows): the speed of light
/// that benchmarks compare `divergences` against.
pub fn plain_pass(p: Rows, q: Rows, rows: usize, vocab: usize) -> KvResult<Vec<f64>> {
    check_pair(&p, &q, rows, vocab)?;
    Ok(parallel::install(|| {
        (0..rows)
            .into_par_iter()
            .map(|r| {
                let mut a = [0.0f64; BLOCK];
                let mut total = [0.0f64; LANES];
                let mut start = 0;
                while start < vocab {
                    let n = BLOCK.min(vocab - start);
                    for rows in [&p, &q] {
                        rows.load(r * vocab + start, &mut a[..n]);
                        for c in a[..n].chunks(LANES) {
                            for (t, x) in total.iter_mut().zip(c) {
                                *t += x;
                            }
                        }
                    }
                    start += n;
                }
                fold(&total)
            })
            .collect()
    }))
}

#[cfg(test)]
mod tests;
