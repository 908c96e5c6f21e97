//! The sharpness construction of SPEC section 5: from a pair and a window L, two pairs whose
//! SMC laws agree with the original up to L lags after the first divergence and whose tails
//! attain the lower end (TV 0 after the window) and the upper end (TV 1 after the window).
//!
//! Alphabet `3V + 2`: tokens `0..V` unmarked, `V..2V` P-marked, `2V..3V` Q-marked, then two end
//! tokens. Before divergence each new kernel tracks both original states `(s_P, s_Q)` (the
//! prefix is shared, so both can) and emits the overlap `min(p, q)` unmarked and its own
//! residual marked: TV, the overlap draw and the divergence law are unchanged. A marked token
//! moves it to `(own state, lag 1)`; for lags `1..=L` it emits its original row unmarked (so
//! the branch coupling is the original one), then it enters the end state: both kernels emit
//! the same end token (lower end) or P and Q different ones (upper end), forever.

use crate::error::{KvError, KvResult};
use crate::synth::exact::check_horizon;
use crate::synth::kernel::{Kernel, KernelPair};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    P,
    Q,
}

fn build(pair: &KernelPair, lags: usize, side: Side, separate: bool) -> KvResult<Kernel> {
    let (p, q) = (&pair.p, &pair.q);
    let v = pair.vocab();
    let own = if side == Side::P { p } else { q };
    let vocab = 3 * v + 2;
    let pre = p.states * q.states;
    let post = |s: usize, lag: usize| pre + s * lags + (lag - 1);
    let end = pre + own.states * lags;
    let states = end + 1;
    let mut emit = vec![0.0; states * vocab];
    let mut next = vec![end as i64; states * vocab];
    let marked = if side == Side::P { v } else { 2 * v };
    let after_divergence = |s: usize| if lags >= 1 { post(s, 1) } else { end } as i64;
    for sp in 0..p.states {
        for sq in 0..q.states {
            let row = sp * q.states + sq;
            let (a, b) = (p.row(sp), q.row(sq));
            for tok in 0..v {
                let (mine, other) = if side == Side::P {
                    (a[tok], b[tok])
                } else {
                    (b[tok], a[tok])
                };
                emit[row * vocab + tok] = mine.min(other);
                next[row * vocab + tok] =
                    (p.next_state(sp, tok) * q.states + q.next_state(sq, tok)) as i64;
                emit[row * vocab + marked + tok] = (mine - other).max(0.0);
                next[row * vocab + marked + tok] =
                    after_divergence(own.next_state(if side == Side::P { sp } else { sq }, tok));
            }
        }
    }
    for s in 0..own.states {
        for lag in 1..=lags {
            let row = post(s, lag);
            for tok in 0..v {
                emit[row * vocab + tok] = own.row(s)[tok];
                let n = own.next_state(s, tok);
                next[row * vocab + tok] = if lag < lags { post(n, lag + 1) } else { end } as i64;
            }
        }
    }
    let end_token = if separate && side == Side::Q {
        3 * v + 1
    } else {
        3 * v
    };
    emit[end * vocab + end_token] = 1.0;
    let name = if side == Side::P { "P" } else { "Q" };
    let start = (p.start * q.states + q.start) as i64;
    Kernel::new(name, &emit, &next, states, vocab, start)
}

/// The `(lower, upper)` construction pairs for horizon `T` and window `L`.
pub fn interval_constructions(
    pair: &KernelPair,
    horizon: usize,
    window: usize,
) -> KvResult<(KernelPair, KernelPair)> {
    check_horizon(horizon)?;
    let lags = window.min(horizon);
    let size = (pair.p.states * pair.q.states + pair.p.states.max(pair.q.states) * lags + 1)
        * (3 * pair.vocab() + 2);
    if size > 1 << 26 {
        return Err(KvError::InvalidArgument(format!(
            "the construction would have {size} table entries; use a smaller pair or window"
        )));
    }
    let make = |separate| -> KvResult<KernelPair> {
        KernelPair::new(
            build(pair, lags, Side::P, separate)?,
            build(pair, lags, Side::Q, separate)?,
        )
    };
    Ok((make(false)?, make(true)?))
}
