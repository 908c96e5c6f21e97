//! Cross-checks of the exact solver, the estimators and the construction.

use crate::parallel;
use crate::synth::construction::interval_constructions;
use crate::synth::exact::exact;
use crate::synth::kernel::{random_pair, Kernel, KernelPair, RandomPairOptions};
use crate::synth::montecarlo::{simulate, Estimators, McOptions, McOutput};

fn pair(seed: u64, vocab: usize, states: usize, markov: bool) -> KernelPair {
    random_pair(&RandomPairOptions {
        vocab,
        states,
        closeness: 0.6,
        sparsity: 0.2,
        absorbing: seed.is_multiple_of(3),
        deterministic: 0.1,
        markov,
        seed,
    })
    .unwrap()
}

fn mean_se(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1.0);
    (m, (var / n).sqrt())
}

fn opts(estimators: Estimators, horizon: usize, window: usize, replicates: usize) -> McOptions {
    McOptions {
        estimators,
        horizon,
        window,
        replicates,
        branches: 2,
        seed: 3,
        trace_to_horizon: true,
    }
}

#[test]
fn decomposition_identity_and_survival() {
    for seed in 0..20 {
        let pr = pair(seed, 4, 3, seed.is_multiple_of(2));
        let e = exact(&pr, 9, 3).unwrap();
        let parts = e.occurrence + e.window_contribution + e.tail_contribution;
        assert!((e.expected_mismatches - parts).abs() < 1e-12);
        let occ: f64 = (1..=9).map(|t| 1.0 - e.survival[t - 1]).sum();
        assert!((occ - e.occupation).abs() < 1e-12);
        assert!((1.0 - e.survival[9] - e.occurrence).abs() < 1e-12);
    }
}

#[test]
fn estimators_agree_with_exact() {
    for seed in 0..6 {
        let pr = pair(seed, 3 + seed as usize % 3, 3, seed % 2 == 1);
        let (t, l) = (8, 3);
        let e = exact(&pr, t, l).unwrap();
        for estimators in [Estimators::Naive, Estimators::IndicatorAndTv] {
            let out = simulate(&pr, &opts(estimators, t, l, 4000)).unwrap();
            let checks: [(&[f64], f64); 6] = [
                (&out.occurrence, e.occurrence),
                (&out.occupation, e.occupation),
                (&out.window_contribution, e.window_contribution),
                (&out.tail_contribution, e.tail_contribution),
                (&out.expected_mismatches, e.expected_mismatches),
                (&out.tail_exposure, e.tail_exposure),
            ];
            for (i, (x, truth)) in checks.iter().enumerate() {
                let (m, se) = mean_se(x);
                assert!(
                    (m - truth).abs() <= 4.5 * se + 1e-12,
                    "seed {seed} {estimators:?} quantity {i}: {m} +- {se} vs {truth}"
                );
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_threads() {
    let pr = pair(4, 5, 4, false);
    let run = |n| -> McOutput {
        parallel::set_num_threads(n).unwrap();
        let out = simulate(&pr, &opts(Estimators::IndicatorAndTv, 12, 4, 300)).unwrap();
        parallel::set_num_threads(0).unwrap();
        out
    };
    assert_eq!(run(1), run(3));
}

#[test]
fn identical_and_disjoint_kernels() {
    let table = [0.5, 0.5, 0.2, 0.8];
    let p = Kernel::markov("P", &table, 2, 0).unwrap();
    let same = KernelPair::new(p.clone(), p.clone()).unwrap();
    let e = exact(&same, 5, 2).unwrap();
    assert_eq!(e.expected_mismatches, 0.0);
    assert!(e.rho().is_nan());
    let q = Kernel::markov("Q", &[0.0, 1.0, 0.0, 1.0], 2, 0).unwrap();
    let p = Kernel::markov("P", &[1.0, 0.0, 1.0, 0.0], 2, 0).unwrap();
    let apart = KernelPair::new(p, q).unwrap();
    let e = exact(&apart, 5, 2).unwrap();
    assert_eq!(e.expected_mismatches, 5.0);
    assert_eq!(e.divergence_time_pmf[0], 1.0);
    let out = simulate(&apart, &opts(Estimators::IndicatorAndTv, 5, 2, 10)).unwrap();
    assert!(out.expected_mismatches.iter().all(|&x| x == 5.0));
}

#[test]
fn constructions_attain_the_interval_ends() {
    for seed in 0..8 {
        let pr = pair(seed, 3, 2 + seed as usize % 3, seed.is_multiple_of(2));
        let (t, l) = (10, 3);
        let e = exact(&pr, t, l).unwrap();
        let (lo, hi) = interval_constructions(&pr, t, l).unwrap();
        let (el, eh) = (exact(&lo, t, l).unwrap(), exact(&hi, t, l).unwrap());
        for c in [&el, &eh] {
            assert!((c.occurrence - e.occurrence).abs() < 1e-12);
            assert!((c.window_contribution - e.window_contribution).abs() < 1e-12);
            assert!((c.tail_exposure - e.tail_exposure).abs() < 1e-12);
            for (x, y) in c.divergence_time_pmf.iter().zip(&e.divergence_time_pmf) {
                assert!((x - y).abs() < 1e-12);
            }
        }
        assert!((el.expected_mismatches - e.interval_lower()).abs() < 1e-12);
        assert!((eh.expected_mismatches - e.interval_upper()).abs() < 1e-12);
        assert!(e.interval_lower() <= e.expected_mismatches + 1e-12);
        assert!(e.expected_mismatches <= e.interval_upper() + 1e-12);
    }
}

#[test]
fn cancelled_solvers_stop_with_interrupted() {
    use crate::cancel::Cancel;
    use crate::error::KvError;
    use crate::synth::exact::exact_with;
    use crate::synth::montecarlo::simulate_with;

    let pr = pair(3, 4, 3, false);
    let c = Cancel::new();
    assert!(exact_with(&pr, 8, 8, &c).is_ok());
    c.cancel();
    assert_eq!(exact_with(&pr, 8, 8, &c), Err(KvError::Interrupted));
    let o = opts(Estimators::IndicatorAndTv, 8, 8, 100);
    assert!(matches!(
        simulate_with(&pr, &o, &c),
        Err(KvError::Interrupted)
    ));
}

#[test]
fn exact_refuses_work_beyond_its_limit() {
    let pr = pair(3, 16, 16, false);
    let e = crate::synth::exact::exact(&pr, 100_000, 100_000).unwrap_err();
    assert!(e.to_string().contains("horizon = 100000"), "{e}");
}
