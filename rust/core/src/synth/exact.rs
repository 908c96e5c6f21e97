//! The exact law of the SMC on a synthetic pair, by dynamic programming (SPEC sections 3, 5).
//!
//! The joint chain lives on `(state_P, state_Q)` before the first divergence and on
//! `(state_P, state_Q, lag class)` after it, where the lag classes are the lags `1..=L` of the
//! window and one class "beyond the window". Step `t` with probability mass `m` on a state pair
//! contributes `m * delta` mismatches; the coupling moves the mass along the overlap tokens
//! (`(1 - delta) min(a, b) / overlap`) and the residual pairs (`delta rP(x) rQ(y)`), the latter
//! aggregated over successor states of each side.
//!
//! **Complexity.** Time `O(T * A * (V + R_P * R_Q) * (min(L, T) + 2))` where `A <= S_P * S_Q` is
//! the number of state pairs reachable at a step and `R <= min(V, S)` the distinct successor
//! states of one residual; memory `O(S_P * S_Q * (min(L, T) + 2))`. For S = V = 16, T = L = 64
//! that is about 3e8 multiply-adds: well under a second.

use crate::cancel::{Cancel, NEVER};
use crate::error::{KvError, KvResult};
use crate::synth::kernel::{Kernel, KernelPair};
use crate::synth::step::{self, StepStats};

/// Everything the exact solver computes; counts, not fractions (divide by T for fractions).
#[derive(Debug, Clone, PartialEq)]
pub struct ExactResult {
    pub horizon: usize,
    pub window: usize,
    /// `P(tau = t)`, t = 1..T.
    pub divergence_time_pmf: Vec<f64>,
    /// `S_t = P(tau > t)`, t = 0..T.
    pub survival: Vec<f64>,
    /// The discrete hazard `P(tau = t | tau >= t)`, t = 1..T (NaN once survival is 0).
    pub hazard: Vec<f64>,
    /// `P(X_t != Y_t)`, t = 1..T.
    pub mismatch_by_step: Vec<f64>,
    /// `E[M] = sum_t P(X_t != Y_t)`.
    pub expected_mismatches: f64,
    /// `P(tau <= T)`.
    pub occurrence: f64,
    /// `E[(T - tau)+]`.
    pub occupation: f64,
    /// `E[mismatches at lags 1..=L after tau]`.
    pub window_contribution: f64,
    /// `E[mismatches at lags > L after tau]`.
    pub tail_contribution: f64,
    /// `E[(T - tau - L)+]`.
    pub tail_exposure: f64,
    /// `E[delta_{tau+l} | tau + l <= T]` for l = 1..=min(L, T - 1) (NaN where that has
    /// probability 0).
    pub branch_tv_by_lag: Vec<f64>,
    /// `P(tau + l <= T)`, the conditioning event's probability, same lags.
    pub branch_lag_weight: Vec<f64>,
}

impl ExactResult {
    pub fn mismatch_fraction(&self) -> f64 {
        self.expected_mismatches / self.horizon as f64
    }
    pub fn first_mismatch(&self) -> f64 {
        self.occurrence / self.horizon as f64
    }
    pub fn exposure(&self) -> f64 {
        self.occupation / self.horizon as f64
    }
    /// `rho`: post-divergence mismatches per post-divergence step (NaN without occupation).
    pub fn rho(&self) -> f64 {
        if self.occupation > 0.0 {
            (self.window_contribution + self.tail_contribution) / self.occupation
        } else {
            f64::NAN
        }
    }
    pub fn interval_lower(&self) -> f64 {
        self.occurrence + self.window_contribution
    }
    pub fn interval_upper(&self) -> f64 {
        self.interval_lower() + self.tail_exposure
    }
}

/// Check horizon and the pair's size for the solvers.
pub fn check_horizon(horizon: usize) -> KvResult<()> {
    if horizon == 0 {
        return Err(KvError::InvalidArgument(
            "horizon must be at least 1 step".into(),
        ));
    }
    if horizon > MAX_HORIZON {
        return Err(KvError::InvalidArgument(format!(
            "horizon = {horizon} is beyond the {MAX_HORIZON} steps the synthetic tools support"
        )));
    }
    Ok(())
}

/// The longest horizon the synthetic tools accept.
pub const MAX_HORIZON: usize = 1 << 20;

/// Masses of the state pairs reachable at one step.
struct Layer {
    classes: usize,
    slot: Vec<u32>,
    pairs: Vec<(usize, usize)>,
    pre: Vec<f64>,
    post: Vec<f64>,
}

impl Layer {
    fn new(sp: usize, sq: usize, classes: usize) -> Self {
        Layer {
            classes,
            slot: vec![u32::MAX; sp * sq],
            pairs: Vec::new(),
            pre: Vec::new(),
            post: Vec::new(),
        }
    }

    fn clear(&mut self, states_q: usize) {
        for &(a, b) in &self.pairs {
            self.slot[a * states_q + b] = u32::MAX;
        }
        self.pairs.clear();
        self.pre.clear();
        self.post.clear();
    }

    fn entry(&mut self, a: usize, b: usize, states_q: usize) -> usize {
        let k = a * states_q + b;
        if self.slot[k] == u32::MAX {
            self.slot[k] = self.pairs.len() as u32;
            self.pairs.push((a, b));
            self.pre.push(0.0);
            self.post.resize(self.post.len() + self.classes, 0.0);
        }
        self.slot[k] as usize
    }
}

/// Successor states of one side's residual, with probabilities (duplicates merged).
fn residual_successors(k: &Kernel, state: usize, res: &[f64], total: f64) -> Vec<(usize, f64)> {
    let mut out: Vec<(usize, f64)> = Vec::new();
    for (v, &w) in res.iter().enumerate() {
        if w > 0.0 {
            let n = k.next_state(state, v);
            let p = w / total;
            match out.iter_mut().find(|(s, _)| *s == n) {
                Some(e) => e.1 += p,
                None => out.push((n, p)),
            }
        }
    }
    out
}

/// The most multiply-adds the exact solver accepts (its worst case for the pair's sizes): at
/// a few 1e8 per second per core this is minutes, beyond which the Monte Carlo estimators are
/// the tool.
pub const MAX_EXACT_WORK: f64 = 3e11;

/// Worst-case multiply-adds of [`exact`]: `T * A * (V + R_P R_Q) * (min(L, T) + 2)` with all
/// `A = S_P S_Q` state pairs reachable and `R = min(V, S)`.
pub fn exact_work(pair: &KernelPair, horizon: usize, window: usize) -> f64 {
    let (p, q, v) = (&pair.p, &pair.q, pair.vocab() as f64);
    let a = p.states as f64 * q.states as f64;
    let r = p.states.min(pair.vocab()) as f64 * q.states.min(pair.vocab()) as f64;
    horizon as f64 * a * (v + r) * (window.min(horizon) as f64 + 2.0)
}

/// Exact quantities of the pair for horizon `T` and window `L` (`L >= T`: the whole horizon).
pub fn exact(pair: &KernelPair, horizon: usize, window: usize) -> KvResult<ExactResult> {
    exact_with(pair, horizon, window, &NEVER)
}

/// [`exact`], stopping with [`KvError::Interrupted`] soon after `cancel` is set.
pub fn exact_with(
    pair: &KernelPair,
    horizon: usize,
    window: usize,
    cancel: &Cancel,
) -> KvResult<ExactResult> {
    check_horizon(horizon)?;
    let (p, q) = (&pair.p, &pair.q);
    let t_max = horizon;
    let l_eff = window.min(t_max);
    let classes = l_eff + 1; // lags 1..=l_eff, then "beyond the window"
    let too_many = match p.states.checked_mul(q.states) {
        Some(n) => n > 1 << 24 || n.saturating_mul(classes) > 1 << 27,
        None => true,
    };
    if too_many {
        return Err(KvError::InvalidArgument(format!(
            "{} x {} state pairs with {classes} lag classes are too many for the exact solver \
             (reduce the states or the window)",
            p.states, q.states
        )));
    }
    let work = exact_work(pair, horizon, window);
    if work > MAX_EXACT_WORK {
        return Err(KvError::InvalidArgument(format!(
            "horizon = {horizon} with window = {window} on {} x {} states (vocab {}) needs up \
             to {work:.2e} operations in the exact solver, above its limit of \
             {MAX_EXACT_WORK:.0e}: use a shorter horizon or window, or the Monte Carlo \
             estimators",
            pair.p.states,
            pair.q.states,
            pair.vocab()
        )));
    }
    let n_lags = window.min(t_max - 1);
    let mut cur = Layer::new(p.states, q.states, classes);
    let mut nxt = Layer::new(p.states, q.states, classes);
    let e = cur.entry(p.start, q.start, q.states);
    cur.pre[e] = 1.0;

    let mut pmf = vec![0.0; t_max];
    let mut mismatch_by_step = vec![0.0; t_max];
    let (mut window_c, mut tail_c) = (0.0, 0.0);
    let mut tv_num = vec![0.0; n_lags];
    let mut tv_den = vec![0.0; n_lags];
    let mut res_p = vec![0.0; p.vocab];
    let mut res_q = vec![0.0; p.vocab];
    let shift = |c: usize| (c + 1).min(l_eff);

    for t in 1..=t_max {
        nxt.clear(q.states);
        for i in 0..cur.pairs.len() {
            cancel.check()?; // one pair's work is at most V + R^2 times the lag classes
            let (sp, sq) = cur.pairs[i];
            let (a, b) = (p.row(sp), q.row(sq));
            let st: StepStats = step::stats(a, b);
            let d = st.delta;
            let pre = cur.pre[i];
            pmf[t - 1] += pre * d;
            mismatch_by_step[t - 1] += pre * d;
            for c in 0..classes {
                let m = cur.post[i * classes + c];
                if m == 0.0 {
                    continue;
                }
                mismatch_by_step[t - 1] += m * d;
                if c < l_eff {
                    window_c += m * d;
                    if c < n_lags {
                        tv_num[c] += m * d;
                        tv_den[c] += m;
                    }
                } else {
                    tail_c += m * d;
                }
            }
            if t == t_max {
                continue;
            }
            let post: Vec<f64> = cur.post[i * classes..(i + 1) * classes].to_vec();
            if d < 1.0 {
                for z in 0..a.len() {
                    let w = a[z].min(b[z]);
                    if w <= 0.0 {
                        continue;
                    }
                    let prob = (1.0 - d) * w / st.overlap;
                    let j = nxt.entry(p.next_state(sp, z), q.next_state(sq, z), q.states);
                    nxt.pre[j] += pre * prob;
                    for (c, &m) in post.iter().enumerate() {
                        nxt.post[j * classes + shift(c)] += m * prob;
                    }
                }
            }
            if d > 0.0 {
                for v in 0..a.len() {
                    res_p[v] = (a[v] - b[v]).max(0.0);
                    res_q[v] = (b[v] - a[v]).max(0.0);
                }
                let succ_p = residual_successors(p, sp, &res_p, st.res_p);
                let succ_q = residual_successors(q, sq, &res_q, st.res_q);
                for &(np, pp) in &succ_p {
                    for &(nq, pq) in &succ_q {
                        let prob = d * pp * pq;
                        let j = nxt.entry(np, nq, q.states);
                        // A fresh divergence is at lag 1 at the next step: class 0.
                        nxt.post[j * classes] += pre * prob;
                        for (c, &m) in post.iter().enumerate() {
                            nxt.post[j * classes + shift(c)] += m * prob;
                        }
                    }
                }
            }
        }
        std::mem::swap(&mut cur, &mut nxt);
    }

    let mut survival = Vec::with_capacity(t_max + 1);
    survival.push(1.0);
    let mut hazard = Vec::with_capacity(t_max);
    for &f in &pmf {
        let prev: f64 = *survival.last().unwrap_or(&1.0);
        hazard.push(if prev > 0.0 { f / prev } else { f64::NAN });
        survival.push((prev - f).max(0.0));
    }
    let occurrence: f64 = pmf.iter().sum();
    let occupation: f64 = pmf
        .iter()
        .enumerate()
        .map(|(i, f)| f * (t_max - i - 1) as f64)
        .sum();
    let tail_exposure: f64 = pmf
        .iter()
        .enumerate()
        .map(|(i, f)| f * (t_max - i - 1).saturating_sub(window) as f64)
        .sum();
    let branch_tv_by_lag = tv_num
        .iter()
        .zip(&tv_den)
        .map(|(n, d)| if *d > 0.0 { n / d } else { f64::NAN })
        .collect();
    Ok(ExactResult {
        horizon,
        window,
        expected_mismatches: mismatch_by_step.iter().sum(),
        divergence_time_pmf: pmf,
        survival,
        hazard,
        mismatch_by_step,
        occurrence,
        occupation,
        window_contribution: window_c,
        tail_contribution: tail_c,
        tail_exposure,
        branch_tv_by_lag,
        branch_lag_weight: tv_den,
    })
}
