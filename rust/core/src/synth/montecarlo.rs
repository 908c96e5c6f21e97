//! Monte Carlo estimators on synthetic pairs (SPEC section 4): naive SMC and RB-CMC.
//!
//! Replicates run in parallel; replicate `r` draws only from its own stream `Rng::stream(seed,
//! r)`, so every output is identical for any thread count. Each estimator returns per-replicate
//! values; means, standard errors and variances are taken by the caller.
//!
//! Uniforms are consumed in a fixed order (the numba reference follows it bit for bit):
//! - naive: three per step (`u0, u1, u2`, see [`crate::synth::step::draw`]);
//! - indicator and tv: one per overlap step (the token; none at the last step or when `delta = 1`), then per
//!   branch one for the branch time, two for the residual pair, and three per traced lag.
//!
//! Simulation stops at a frozen state pair ([`Stepper::frozen`], e.g. both kernels after EOS).

use rayon::prelude::*;

use crate::cancel::{Cancel, NEVER};
use crate::error::{KvError, KvResult};
use crate::parallel;
use crate::synth::exact::check_horizon;
use crate::synth::kernel::KernelPair;
use crate::synth::rng::Rng;
use crate::synth::step::{inverse_cdf, RowStepper, Stepper, TableStepper};

/// The estimators one run computes (the analysis's words; synth adds naive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Estimators {
    /// `naive`: simulate the SMC and count mismatches.
    Naive,
    /// RB-CMC's two, from the same branches: `indicator` (the branches' mismatch indicators)
    /// and `tv` (their branch-aligned TVs, the `*_tv` outputs).
    IndicatorAndTv,
}

#[derive(Debug, Clone)]
pub struct McOptions {
    pub estimators: Estimators,
    pub horizon: usize,
    pub window: usize,
    pub replicates: usize,
    /// Branches per replicate (indicator and tv only).
    pub branches: usize,
    pub seed: u64,
    /// Trace branches to the horizon (else only the window: tail and total are NaN).
    pub trace_to_horizon: bool,
}

/// Per-replicate values, one entry per replicate (`*_by_lag`: replicate-major, `lags` per row).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct McOutput {
    pub lags: usize,
    pub occurrence: Vec<f64>,
    pub occupation: Vec<f64>,
    pub tail_exposure: Vec<f64>,
    pub window_contribution: Vec<f64>,
    pub tail_contribution: Vec<f64>,
    pub expected_mismatches: Vec<f64>,
    /// The `tv` estimator's values (empty for naive).
    pub window_contribution_tv: Vec<f64>,
    pub tail_contribution_tv: Vec<f64>,
    pub expected_mismatches_tv: Vec<f64>,
    /// Numerator and denominator of `branch_tv_by_lag`: estimates of
    /// `E[delta_{tau+l} 1{tau+l <= T}]` and `P(tau + l <= T)`.
    pub branch_tv_sum: Vec<f64>,
    pub branch_lag_weight: Vec<f64>,
    /// Kernel evaluations (each step evaluates P and Q: 2 per step).
    pub evaluations: Vec<f64>,
}

#[derive(Default)]
struct Replicate {
    occurrence: f64,
    occupation: f64,
    tail_exposure: f64,
    window: f64,
    tail: f64,
    total: f64,
    window_tv: f64,
    tail_tv: f64,
    total_tv: f64,
    evaluations: f64,
}

/// One replicate's rows of the by-lag outputs.
struct LagRows<'a> {
    tv_sum: &'a mut [f64],
    weight: &'a mut [f64],
}

fn uniforms3(rng: &mut Rng) -> [f64; 3] {
    let u0 = rng.uniform();
    let u1 = rng.uniform();
    let u2 = rng.uniform();
    [u0, u1, u2]
}

fn naive_replicate<S: Stepper>(
    pair: &KernelPair,
    steps: &S,
    o: &McOptions,
    lags: usize,
    rng: &mut Rng,
    by_lag: LagRows,
) -> Replicate {
    let (p, q, t_max, win) = (&pair.p, &pair.q, o.horizon, o.window);
    let mut r = Replicate::default();
    let (mut sp, mut sq) = (p.start, q.start);
    let mut tau: Option<usize> = None;
    let (mut window_n, mut tail_n) = (0usize, 0usize);
    for t in 1..=t_max {
        if steps.frozen(sp, sq) {
            // No more mismatches; later lags still count in the TV-by-lag weights (TV 0).
            if let Some(t0) = tau {
                for lag in (t - t0)..=lags.min(t_max - t0) {
                    by_lag.weight[lag - 1] += 1.0;
                }
            }
            break;
        }
        let st = steps.stats(sp, sq);
        r.evaluations += 2.0;
        let (x, y) = steps.draw(sp, sq, &st, uniforms3(rng));
        let mismatch = x != y;
        match tau {
            None if mismatch => tau = Some(t),
            None => {}
            Some(t0) => {
                let lag = t - t0;
                if lag <= lags {
                    by_lag.tv_sum[lag - 1] += st.delta;
                    by_lag.weight[lag - 1] += 1.0;
                }
                if lag <= win {
                    window_n += mismatch as usize;
                } else {
                    tail_n += mismatch as usize;
                }
            }
        }
        if let Some(t0) = tau {
            if !o.trace_to_horizon && t - t0 >= win {
                break;
            }
        }
        sp = p.next_state(sp, x);
        sq = q.next_state(sq, y);
    }
    if let Some(t0) = tau {
        r.occurrence = 1.0;
        r.occupation = (t_max - t0) as f64;
        r.tail_exposure = (t_max - t0).saturating_sub(win) as f64;
    }
    r.window = window_n as f64;
    if o.trace_to_horizon {
        r.tail = tail_n as f64;
        r.total = r.occurrence + r.window + r.tail;
    } else {
        r.tail = f64::NAN;
        r.total = f64::NAN;
    }
    r
}

fn branch_replicate<S: Stepper>(
    pair: &KernelPair,
    steps: &S,
    o: &McOptions,
    lags: usize,
    rng: &mut Rng,
    scratch: &mut Scratch,
    by_lag: LagRows,
) -> Replicate {
    let (p, q, t_max, win) = (&pair.p, &pair.q, o.horizon, o.window);
    let mut r = Replicate::default();
    // 1. The overlap path: states at each step and weights W_{t-1} h_t.
    let Scratch { path, weights } = scratch;
    path.clear();
    weights.clear();
    let (mut sp, mut sq) = (p.start, q.start);
    let mut survival = 1.0;
    for t in 1..=t_max {
        if steps.frozen(sp, sq) {
            break; // the hazard is 0 from here on
        }
        let st = steps.stats(sp, sq);
        r.evaluations += 2.0;
        path.push((sp, sq));
        weights.push(survival * st.delta);
        if st.delta >= 1.0 {
            break; // the overlap is empty: every path diverges here
        }
        survival *= 1.0 - st.delta;
        if t == t_max {
            break;
        }
        let z = steps.overlap_token(sp, sq, &st, rng.uniform());
        sp = p.next_state(sp, z);
        sq = q.next_state(sq, z);
    }
    // 2. Occurrence, occupation, tail exposure and lag weights, with no coin flipped.
    for (i, &w) in weights.iter().enumerate() {
        let after = t_max - (i + 1); // steps after a divergence at t = i + 1
        r.occurrence += w;
        r.occupation += w * after as f64;
        r.tail_exposure += w * after.saturating_sub(win) as f64;
    }
    // P(tau + l <= T) = sum of w_t over t <= T - l: prefix sums of the weights.
    let mut prefix = 0.0;
    let mut next_t = 1;
    for lag in (1..=lags).rev() {
        while next_t <= (t_max - lag).min(weights.len()) {
            prefix += weights[next_t - 1];
            next_t += 1;
        }
        by_lag.weight[lag - 1] = prefix;
    }
    let occ = r.occurrence;
    // 3. Branches from t* ~ W_{t-1} h_t / O.
    let (mut win_n, mut tail_n, mut win_tv, mut tail_tv) = (0.0, 0.0, 0.0, 0.0);
    let k = o.branches;
    if occ > 0.0 && k > 0 {
        for _ in 0..k {
            let i = inverse_cdf(weights, weights, rng.uniform() * occ, |w, _| w);
            let (sp0, sq0) = path[i];
            let st = steps.stats(sp0, sq0); // the path already evaluated these rows
            let u1 = rng.uniform();
            let u2 = rng.uniform();
            let (x, y) = steps.residual_tokens(sp0, sq0, &st, [u1, u2]);
            let (mut sp, mut sq) = (p.next_state(sp0, x), q.next_state(sq0, y));
            let mut max_lag = t_max - (i + 1);
            if !o.trace_to_horizon {
                max_lag = max_lag.min(win);
            }
            for lag in 1..=max_lag {
                if steps.frozen(sp, sq) {
                    break;
                }
                let st = steps.stats(sp, sq);
                r.evaluations += 2.0;
                let (x, y) = steps.draw(sp, sq, &st, uniforms3(rng));
                let mismatch = (x != y) as u8 as f64;
                if lag <= lags {
                    by_lag.tv_sum[lag - 1] += st.delta;
                }
                if lag <= win {
                    win_n += mismatch;
                    win_tv += st.delta;
                } else {
                    tail_n += mismatch;
                    tail_tv += st.delta;
                }
                sp = p.next_state(sp, x);
                sq = q.next_state(sq, y);
            }
        }
    }
    // 4. Estimates: O times the mean over branches.
    let scale = if k > 0 { occ / k as f64 } else { 0.0 };
    by_lag.tv_sum.iter_mut().for_each(|v| *v *= scale);
    r.window = scale * win_n;
    r.window_tv = scale * win_tv;
    if o.trace_to_horizon {
        r.tail = scale * tail_n;
        r.tail_tv = scale * tail_tv;
        r.total = occ + r.window + r.tail;
        r.total_tv = occ + r.window_tv + r.tail_tv;
    } else {
        r.tail = f64::NAN;
        r.tail_tv = f64::NAN;
        r.total = f64::NAN;
        r.total_tv = f64::NAN;
    }
    r
}

/// Reusable buffers of one worker (the branches' overlap path).
#[derive(Default)]
struct Scratch {
    path: Vec<(usize, usize)>,
    weights: Vec<f64>,
}

/// All replicates; the by-lag outputs are written in place (`lags` values per replicate).
fn run<S: Stepper>(
    pair: &KernelPair,
    steps: &S,
    o: &McOptions,
    lags: usize,
    cancel: &Cancel,
) -> (Vec<Replicate>, Vec<f64>, Vec<f64>) {
    let n = o.replicates;
    let width = lags.max(1); // chunks of 0 are not allowed; trimmed below
    let mut tv_sum = vec![0.0; n * width];
    let mut weight = vec![0.0; n * width];
    let reps = parallel::install(|| {
        tv_sum
            .par_chunks_mut(width)
            .zip(weight.par_chunks_mut(width))
            .enumerate()
            .with_min_len(64)
            .map_init(Scratch::default, |scratch, (i, (tv, w))| {
                if cancel.is_cancelled() {
                    return Replicate::default(); // discarded: simulate returns Interrupted
                }
                let mut rng = Rng::stream(o.seed, i as u64);
                let by_lag = LagRows {
                    tv_sum: &mut tv[..lags],
                    weight: &mut w[..lags],
                };
                match o.estimators {
                    Estimators::Naive => naive_replicate(pair, steps, o, lags, &mut rng, by_lag),
                    Estimators::IndicatorAndTv => {
                        branch_replicate(pair, steps, o, lags, &mut rng, scratch, by_lag)
                    }
                }
            })
            .collect()
    });
    if lags == 0 {
        tv_sum.clear();
        weight.clear();
    }
    (reps, tv_sum, weight)
}

/// Run `o.replicates` replicates of the chosen estimator.
pub fn simulate(pair: &KernelPair, o: &McOptions) -> KvResult<McOutput> {
    simulate_with(pair, o, &NEVER)
}

/// [`simulate`], stopping with [`KvError::Interrupted`] soon after `cancel` is set.
pub fn simulate_with(pair: &KernelPair, o: &McOptions, cancel: &Cancel) -> KvResult<McOutput> {
    check_horizon(o.horizon)?;
    if o.replicates == 0 {
        return Err(KvError::InvalidArgument(
            "replicates must be at least 1".into(),
        ));
    }
    if o.estimators == Estimators::IndicatorAndTv && o.branches == 0 {
        return Err(KvError::InvalidArgument(
            "the indicator and tv estimators need at least 1 branch per replicate".into(),
        ));
    }
    let lags = o.window.min(o.horizon - 1);
    let too_many = match o.replicates.checked_mul(lags.max(1)) {
        Some(n) => n > 1 << 27,
        None => true,
    };
    if too_many {
        return Err(KvError::InvalidArgument(format!(
            "{} replicates x {lags} lags of branch TVs would not fit in memory; \
             use fewer replicates or a shorter window",
            o.replicates
        )));
    }
    // Small pairs get precomputed step tables; both steppers give identical tokens.
    let (reps, tv_sum, weight) = match TableStepper::build(pair) {
        Some(table) => run(pair, &table, o, lags, cancel),
        None => run(pair, &RowStepper(pair), o, lags, cancel),
    };
    cancel.check()?;
    let col = |f: fn(&Replicate) -> f64| reps.iter().map(f).collect::<Vec<f64>>();
    let tv = o.estimators == Estimators::IndicatorAndTv;
    Ok(McOutput {
        lags,
        occurrence: col(|r| r.occurrence),
        occupation: col(|r| r.occupation),
        tail_exposure: col(|r| r.tail_exposure),
        window_contribution: col(|r| r.window),
        tail_contribution: col(|r| r.tail),
        expected_mismatches: col(|r| r.total),
        window_contribution_tv: if tv { col(|r| r.window_tv) } else { vec![] },
        tail_contribution_tv: if tv { col(|r| r.tail_tv) } else { vec![] },
        expected_mismatches_tv: if tv { col(|r| r.total_tv) } else { vec![] },
        branch_tv_sum: tv_sum,
        branch_lag_weight: weight,
        evaluations: col(|r| r.evaluations),
    })
}
