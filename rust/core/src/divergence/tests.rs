//! Tests of `divergence`: against naive formulas, edge rows, errors, half formats.
use super::*;

fn naive(p: &[f64], q: &[f64]) -> RowDivergence {
    let xlogy = |x: f64, y: f64| if x == 0.0 { 0.0 } else { x * y.ln() };
    let mut r = RowDivergence {
        tv: 0.0,
        kl_pq: 0.0,
        kl_qp: 0.0,
        js: 0.0,
        hellinger: 0.0,
        entropy_p: 0.0,
        entropy_q: 0.0,
        overlap: 0.0,
        top1_agree: false,
    };
    let mut h = 0.0;
    for (&a, &b) in p.iter().zip(q) {
        let m = 0.5 * (a + b);
        r.tv += 0.5 * (a - b).abs();
        r.kl_pq += if a > 0.0 && b == 0.0 {
            f64::INFINITY
        } else {
            xlogy(a, a) - xlogy(a, b)
        };
        r.kl_qp += if b > 0.0 && a == 0.0 {
            f64::INFINITY
        } else {
            xlogy(b, b) - xlogy(b, a)
        };
        r.js += 0.5 * (xlogy(a, a) + xlogy(b, b)) - xlogy(m, m);
        r.entropy_p -= xlogy(a, a);
        r.entropy_q -= xlogy(b, b);
        h += (a.sqrt() - b.sqrt()).powi(2);
    }
    r.hellinger = (0.5 * h).sqrt();
    r.overlap = 1.0 - r.tv;
    r
}

fn close(a: f64, b: f64) -> bool {
    (a.is_infinite() && a == b) || (a - b).abs() <= 1e-12 * (1.0 + b.abs())
}

fn assert_matches(p: &[f64], q: &[f64]) {
    let v = p.len();
    let got = divergences(Rows::F64(p), Rows::F64(q), 1, v, &Options::default()).unwrap()[0];
    let want = naive(p, q);
    for (name, g, w) in [
        ("tv", got.tv, want.tv),
        ("kl_pq", got.kl_pq, want.kl_pq),
        ("kl_qp", got.kl_qp, want.kl_qp),
        ("js", got.js, want.js),
        ("hellinger", got.hellinger, want.hellinger),
        ("entropy_p", got.entropy_p, want.entropy_p),
        ("entropy_q", got.entropy_q, want.entropy_q),
    ] {
        assert!(close(g, w.max(0.0)), "{name}: got {g}, want {w}");
    }
}

#[test]
fn random_rows_match_naive_formulas() {
    let mut state = 12345u64;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 11) as f64) / ((1u64 << 53) as f64)
    };
    for &v in &[1usize, 2, 3, 7, 8, 9, 1023, 1024, 1025, 5000] {
        let mut p: Vec<f64> = (0..v).map(|_| next()).collect();
        let mut q: Vec<f64> = (0..v).map(|_| next()).collect();
        let (sp, sq): (f64, f64) = (p.iter().sum(), q.iter().sum());
        p.iter_mut().for_each(|x| *x /= sp);
        q.iter_mut().for_each(|x| *x /= sq);
        assert_matches(&p, &q);
    }
}

#[test]
fn edge_rows() {
    assert_matches(&[1.0, 0.0], &[0.0, 1.0]); // disjoint: TV 1, KL inf
    assert_matches(&[0.5, 0.5], &[0.5, 0.5]); // identical
    assert_matches(&[1.0], &[1.0]); // vocab 1
    let d = divergences(
        Rows::F64(&[1.0, 0.0]),
        Rows::F64(&[0.0, 1.0]),
        1,
        2,
        &Options::default(),
    )
    .unwrap()[0];
    assert_eq!(d.tv, 1.0);
    assert_eq!(d.kl_pq, f64::INFINITY);
    assert!(!d.top1_agree);
    assert!((d.js - std::f64::consts::LN_2).abs() < 1e-15);
}

#[test]
fn errors_name_first_bad_row() {
    let p = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5];
    let q = [0.5, 0.5, 0.7, 0.3, -0.1, 1.1];
    let e = divergences(Rows::F64(&p), Rows::F64(&q), 3, 2, &Options::default()).unwrap_err();
    assert_eq!(e, KvError::row(2, "contains a negative probability"));
    let q = [0.5, 0.5, f64::NAN, 0.5, 0.5, 0.5];
    let e = divergences(Rows::F64(&p), Rows::F64(&q), 3, 2, &Options::default()).unwrap_err();
    assert!(matches!(e, KvError::InvalidRow { row: 1, .. }));
    let q = [0.5, 0.5, 0.5, 0.6, 0.5, 0.5];
    let e = divergences(Rows::F64(&p), Rows::F64(&q), 3, 2, &Options::default()).unwrap_err();
    assert!(matches!(e, KvError::InvalidRow { row: 1, .. }));
    let opts = Options {
        renormalize: true,
        ..Default::default()
    };
    assert!(divergences(Rows::F64(&p), Rows::F64(&q), 3, 2, &opts).is_ok());
    assert!(matches!(
        divergences(Rows::F64(&[]), Rows::F64(&[]), 0, 2, &opts),
        Err(KvError::Shape(_))
    ));
}

#[test]
fn half_inputs_match_f64() {
    // 0x3800 = 0.5 in f16; 0x3f00 = 0.5 in bf16.
    let h = [0x3800u16, 0x3800];
    let d = divergences(Rows::F16(&h), Rows::F16(&h), 1, 2, &Options::default()).unwrap()[0];
    assert_eq!(d.tv, 0.0);
    assert!((d.entropy_p - std::f64::consts::LN_2).abs() < 1e-15);
    let b = [0x3f00u16, 0x3f00];
    let d = divergences(Rows::BF16(&b), Rows::BF16(&b), 1, 2, &Options::default()).unwrap()[0];
    assert!((d.entropy_q - std::f64::consts::LN_2).abs() < 1e-15);
}

fn top1(p: &[f64], q: &[f64]) -> bool {
    divergences(Rows::F64(p), Rows::F64(q), 1, p.len(), &Options::default()).unwrap()[0].top1_agree
}

#[test]
fn top1_ties_take_the_first_index() {
    // Random rows almost never tie at the maximum: fixed cases, on either side.
    assert!(top1(&[0.5, 0.5, 0.0], &[0.6, 0.4, 0.0]));
    assert!(top1(&[0.6, 0.4, 0.0], &[0.5, 0.5, 0.0]));
    assert!(!top1(&[0.5, 0.5, 0.0], &[0.4, 0.6, 0.0]));
    assert!(!top1(&[0.4, 0.6, 0.0], &[0.5, 0.5, 0.0]));
    assert!(!top1(&[0.0, 0.5, 0.5], &[0.0, 0.4, 0.6]));
    assert!(top1(&[0.2, 0.4, 0.4], &[0.2, 0.5, 0.3]));
    assert!(top1(&[0.25; 4], &[0.4, 0.2, 0.2, 0.2]));
    assert!(!top1(&[0.25; 4], &[0.2, 0.2, 0.2, 0.4]));
    // Both sides tied: the first maxima agree although the last ones do not.
    assert!(top1(&[0.5, 0.5, 0.0], &[0.5, 0.0, 0.5]));
}

fn normalised(v: usize, weights: &[(usize, f64)]) -> Vec<f64> {
    let mut row = vec![1.0; v];
    for &(i, w) in weights {
        row[i] = w;
    }
    let total: f64 = row.iter().sum();
    row.iter().map(|x| x / total).collect()
}

#[test]
fn top1_ties_across_and_within_blocks() {
    // A maximum repeated in a later block (the block scan must keep the first one) and
    // within one block past the first lanes.
    let v = 3000;
    let p = normalised(v, &[(3, 2.0), (1500, 2.0), (2999, 2.0)]);
    assert!(top1(&p, &normalised(v, &[(3, 3.0)])));
    assert!(!top1(&p, &normalised(v, &[(2999, 3.0)])));
    let p = normalised(v, &[(9, 2.0), (10, 2.0)]);
    assert!(top1(&p, &normalised(v, &[(9, 3.0)])));
    assert!(!top1(&p, &normalised(v, &[(10, 3.0)])));
    // All entries equal: both first maxima are index 0.
    assert!(top1(&normalised(v, &[]), &normalised(v, &[(0, 1.5)])));
    assert!(!top1(&normalised(v, &[]), &normalised(v, &[(v - 1, 1.5)])));
}
