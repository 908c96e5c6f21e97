//! Synthetic kernels (SPEC section 6): probabilistic finite-state emitters, the first-order
//! Markov shorthand, validation, and a seeded generator of random pairs.

use crate::error::{KvError, KvResult};
use crate::synth::rng::Rng;

/// Rows of `emit` must sum to 1 within this; they are then renormalised.
pub const ROW_ATOL: f64 = 1e-6;
/// Rows whose sum is within this of 1 are used exactly as given.
pub const EXACT_ATOL: f64 = 1e-12;

/// A probabilistic finite-state emitter over tokens `0..vocab`: in state `s` it emits `v` with
/// probability `emit[s * vocab + v]` and moves to state `next[s * vocab + v]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Kernel {
    pub states: usize,
    pub vocab: usize,
    pub emit: Vec<f64>,
    pub next: Vec<usize>,
    pub start: usize,
}

impl Kernel {
    /// Validate and build an emitter; `name` ("P" or "Q") prefixes every error message.
    pub fn new(
        name: &str,
        emit: &[f64],
        next: &[i64],
        states: usize,
        vocab: usize,
        start: i64,
    ) -> KvResult<Self> {
        let bad = |what: String| KvError::InvalidKernel(format!("{name}: {what}"));
        if states == 0 || vocab == 0 {
            return Err(bad(format!(
                "{name}_emit has shape ({states}, {vocab}); it needs at least one state and one token"
            )));
        }
        if emit.len() != states * vocab || next.len() != states * vocab {
            return Err(bad(format!(
                "{name}_emit has {} entries and {name}_next {}, expected ({states}, {vocab}) each",
                emit.len(),
                next.len()
            )));
        }
        if start < 0 || start as usize >= states {
            return Err(bad(format!(
                "{name}_start = {start} is outside the states 0..{states}"
            )));
        }
        let mut rows = Vec::with_capacity(emit.len());
        for s in 0..states {
            let row = &emit[s * vocab..(s + 1) * vocab];
            if let Some(v) = row.iter().position(|x| !x.is_finite() || *x < 0.0) {
                return Err(bad(format!(
                    "{name}_emit[{s}, {v}] = {} is not a probability",
                    row[v]
                )));
            }
            let total: f64 = row.iter().sum();
            if (total - 1.0).abs() > ROW_ATOL {
                return Err(bad(format!(
                    "{name}_emit row {s} sums to {total:.9}, not 1 (rows must be stochastic within {ROW_ATOL})"
                )));
            }
            // Sums off by rounding only are kept as given: rescaling them would perturb rows
            // that should stay equal (the interval construction relies on it).
            let scale = if (total - 1.0).abs() <= EXACT_ATOL {
                1.0
            } else {
                1.0 / total
            };
            rows.extend(row.iter().map(|x| x * scale));
        }
        let mut next_states = Vec::with_capacity(next.len());
        for (i, &n) in next.iter().enumerate() {
            if n < 0 || n as usize >= states {
                return Err(bad(format!(
                    "{name}_next[{}, {}] = {n} is outside the states 0..{states}",
                    i / vocab,
                    i % vocab
                )));
            }
            next_states.push(n as usize);
        }
        Ok(Kernel {
            states,
            vocab,
            emit: rows,
            next: next_states,
            start: start as usize,
        })
    }

    /// A first-order Markov table `table[V, V]` (row = previous token) started at token `start`:
    /// the emitter with `S = V` and `next[s, v] = v`.
    pub fn markov(name: &str, table: &[f64], vocab: usize, start: i64) -> KvResult<Self> {
        let next: Vec<i64> = (0..vocab * vocab).map(|i| (i % vocab) as i64).collect();
        Kernel::new(name, table, &next, vocab, vocab, start)
    }

    #[inline(always)]
    pub fn row(&self, state: usize) -> &[f64] {
        &self.emit[state * self.vocab..(state + 1) * self.vocab]
    }

    #[inline(always)]
    pub fn next_state(&self, state: usize, token: usize) -> usize {
        self.next[state * self.vocab + token]
    }
}

/// Two kernels over one vocabulary: P the reference, Q the perturbed.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelPair {
    pub p: Kernel,
    pub q: Kernel,
}

impl KernelPair {
    pub fn new(p: Kernel, q: Kernel) -> KvResult<Self> {
        if p.vocab != q.vocab {
            return Err(KvError::InvalidKernel(format!(
                "P has {} tokens but Q has {}; a pair shares one vocabulary",
                p.vocab, q.vocab
            )));
        }
        Ok(KernelPair { p, q })
    }

    pub fn vocab(&self) -> usize {
        self.p.vocab
    }
}

/// Settings of [`random_pair`].
#[derive(Debug, Clone)]
pub struct RandomPairOptions {
    pub vocab: usize,
    /// Emitter states (ignored when `markov`).
    pub states: usize,
    /// 1: Q emits exactly as P; 0: Q's rows and transitions are drawn independently.
    pub closeness: f64,
    /// Probability that an emission entry is zero (every row keeps at least one token).
    pub sparsity: f64,
    /// Make token `V - 1` an absorbing EOS: after it, the kernel emits it forever.
    pub absorbing: bool,
    /// Probability that a row is deterministic (a point mass).
    pub deterministic: f64,
    /// First-order Markov tables (S = V, next state = last token).
    pub markov: bool,
    pub seed: u64,
}

fn random_row(rng: &mut Rng, vocab: usize, sparsity: f64, deterministic: f64) -> Vec<f64> {
    let mut row = vec![0.0; vocab];
    if rng.uniform() < deterministic {
        row[rng.below(vocab)] = 1.0;
        return row;
    }
    // Dirichlet(1) weights on a random support.
    let keep = rng.below(vocab);
    for (v, w) in row.iter_mut().enumerate() {
        let e = -(1.0 - rng.uniform()).ln();
        if v == keep || rng.uniform() >= sparsity {
            *w = e + 1e-3;
        }
    }
    let total: f64 = row.iter().sum();
    row.iter_mut().for_each(|w| *w /= total);
    row
}

/// A random pair for tests and tutorials; the same options and seed give the same pair.
pub fn random_pair(o: &RandomPairOptions) -> KvResult<KernelPair> {
    let v = o.vocab;
    let s = if o.markov { v } else { o.states };
    if v == 0 || s == 0 {
        return Err(KvError::InvalidArgument(format!(
            "vocab = {v} and states = {s} must both be at least 1"
        )));
    }
    let too_big = match s.checked_mul(v) {
        Some(n) => n > 1 << 26,
        None => true,
    };
    if too_big {
        return Err(KvError::InvalidArgument(format!(
            "{s} states x {v} tokens is too large for a random pair"
        )));
    }
    if o.absorbing && (v < 2 || (!o.markov && s < 2)) {
        return Err(KvError::InvalidArgument(
            "an absorbing EOS needs at least 2 tokens and 2 states".into(),
        ));
    }
    for (what, x) in [
        ("closeness", o.closeness),
        ("sparsity", o.sparsity),
        ("deterministic", o.deterministic),
    ] {
        if !(0.0..=1.0).contains(&x) {
            return Err(KvError::InvalidArgument(format!(
                "{what} = {x} must lie in [0, 1]"
            )));
        }
    }
    let mut rng = Rng::stream(o.seed, 0x5e_ed);
    let eos = v - 1;
    let eos_state = if o.markov { eos } else { s - 1 };
    let mut p_emit = Vec::with_capacity(s * v);
    let mut q_emit = Vec::with_capacity(s * v);
    for _ in 0..s {
        let pr = random_row(&mut rng, v, o.sparsity, o.deterministic);
        let fresh = random_row(&mut rng, v, o.sparsity, o.deterministic);
        // Some rows of Q are independent of P's, so TV 1 steps occur.
        let independent = rng.uniform() < o.deterministic;
        p_emit.extend_from_slice(&pr);
        if independent {
            q_emit.extend_from_slice(&fresh);
        } else {
            q_emit.extend(
                pr.iter()
                    .zip(&fresh)
                    .map(|(a, b)| o.closeness * a + (1.0 - o.closeness) * b),
            );
        }
    }
    let mut p_next = vec![0i64; s * v];
    let mut q_next = vec![0i64; s * v];
    for i in 0..s * v {
        if o.markov {
            p_next[i] = (i % v) as i64;
            q_next[i] = p_next[i];
        } else {
            p_next[i] = rng.below(s) as i64;
            q_next[i] = if rng.uniform() < o.closeness {
                p_next[i]
            } else {
                rng.below(s) as i64
            };
        }
    }
    if o.absorbing {
        for (emit, next) in [(&mut p_emit, &mut p_next), (&mut q_emit, &mut q_next)] {
            for st in 0..s {
                next[st * v + eos] = eos_state as i64;
            }
            let row = &mut emit[eos_state * v..(eos_state + 1) * v];
            row.iter_mut().for_each(|w| *w = 0.0);
            row[eos] = 1.0;
            next[eos_state * v..(eos_state + 1) * v]
                .iter_mut()
                .for_each(|n| *n = eos_state as i64);
        }
    }
    // Never start in the EOS state (the last one in both layouts).
    let start = if o.absorbing {
        rng.below(s - 1)
    } else {
        rng.below(s)
    } as i64;
    KernelPair::new(
        Kernel::new("P", &p_emit, &p_next, s, v, start)?,
        Kernel::new("Q", &q_emit, &q_next, s, v, start)?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        let e = Kernel::new("P", &[0.5, 0.4], &[0, 0], 1, 2, 0).unwrap_err();
        assert!(e.to_string().contains("P_emit row 0 sums to"), "{e}");
        let e = Kernel::new("Q", &[0.5, 0.5], &[0, 3], 1, 2, 0).unwrap_err();
        assert!(e.to_string().contains("Q_next[0, 1] = 3"), "{e}");
        let e = Kernel::new("P", &[0.5, 0.5], &[0, 0], 1, 2, 1).unwrap_err();
        assert!(e.to_string().contains("P_start = 1"), "{e}");
        let e = Kernel::new("P", &[1.5, -0.5], &[0, 0], 1, 2, 0).unwrap_err();
        assert!(e.to_string().contains("P_emit[0, 1]"), "{e}");
    }

    #[test]
    fn random_pairs_are_valid_and_reproducible() {
        for (markov, absorbing) in [(false, false), (true, false), (false, true), (true, true)] {
            let o = RandomPairOptions {
                vocab: 5,
                states: 4,
                closeness: 0.7,
                sparsity: 0.3,
                absorbing,
                deterministic: 0.2,
                markov,
                seed: 11,
            };
            let a = random_pair(&o).unwrap();
            assert_eq!(a, random_pair(&o).unwrap());
            if absorbing {
                let st = a.p.next_state(a.p.start, 4);
                assert_eq!(a.p.row(st)[4], 1.0);
                assert_eq!(a.p.next_state(st, 4), st);
            }
        }
    }
}
