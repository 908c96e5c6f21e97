"""numba reference of the naive and RB-CMC estimators on synthetic pairs (SPEC section 4).

The same algorithms and the same random numbers as the Rust core (xoshiro256++ seeded by
SplitMix64, one stream per replicate, uniforms consumed in the same order), written as plain
loops: a test oracle (replicate values must match the Rust ones) and the benchmark peer.
Inputs are a pair's validated arrays (``KernelPair.arrays()``); branches trace to the horizon.
"""

from __future__ import annotations

import numba
import numpy as np

from kvcouple.deprecation import warn_renamed

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_STREAM = np.uint64(0x632BE59BD9B4E019)


@numba.njit(cache=True)
def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True)
def _rotl(x, k):
    return (x << np.uint64(k)) | (x >> np.uint64(64 - k))


@numba.njit(cache=True)
def _stream(seed, index):
    """State of replicate ``index``'s generator (``Rng::stream`` in Rust)."""
    sm = _mix64(np.uint64(seed) ^ _mix64(np.uint64(index) + _STREAM))
    s = np.empty(4, dtype=np.uint64)
    for i in range(4):
        sm = sm + _GOLDEN
        s[i] = _mix64(sm)
    return s


@numba.njit(cache=True)
def _uniform(s):
    result = _rotl(s[0] + s[3], 23) + s[0]
    t = s[1] << np.uint64(17)
    s[2] ^= s[0]
    s[3] ^= s[1]
    s[1] ^= s[2]
    s[0] ^= s[3]
    s[2] ^= t
    s[3] = _rotl(s[3], 45)
    return float(result >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@numba.njit(cache=True)
def _stats(a, b):
    """delta, overlap, residual masses of P and Q (rows identical up to rounding: delta 0)."""
    abs_diff = 0.0
    overlap = 0.0
    res_p = 0.0
    res_q = 0.0
    for i in range(a.shape[0]):
        d = a[i] - b[i]
        abs_diff += abs(d)
        overlap += min(a[i], b[i])
        res_p += max(d, 0.0)
        res_q += max(-d, 0.0)
    if overlap <= 0.0:
        delta = 1.0
    elif res_p <= 0.0 or res_q <= 0.0:
        delta = 0.0
    else:
        delta = min(0.5 * abs_diff, 1.0)
    return delta, overlap, res_p, res_q


@numba.njit(cache=True)
def _pick(a, b, kind, target):
    """Inverse CDF of weight ``kind`` (0 overlap, 1 residual P, 2 residual Q)."""
    cum = 0.0
    last = 0
    for i in range(a.shape[0]):
        if kind == 0:
            w = min(a[i], b[i])
        elif kind == 1:
            w = max(a[i] - b[i], 0.0)
        else:
            w = max(b[i] - a[i], 0.0)
        if w > 0.0:
            last = i
            cum += w
            if cum > target:
                return i
    return last


@numba.njit(cache=True)
def _couple(a, b, u0, u1, u2):
    delta, overlap, res_p, res_q = _stats(a, b)
    if u0 >= delta:
        z = _pick(a, b, 0, u1 * overlap)
        return z, z, delta
    return _pick(a, b, 1, u1 * res_p), _pick(a, b, 2, u2 * res_q), delta


@numba.njit(cache=True)
def _frozen(pe, pn, qe, qn, sp, sq):
    """Identical rows whose every token leads back to (sp, sq): stop simulating (EOS)."""
    delta, _, _, _ = _stats(pe[sp], qe[sq])
    if delta != 0.0:
        return False
    for z in range(pe.shape[1]):
        if min(pe[sp, z], qe[sq, z]) > 0.0 and (pn[sp, z] != sp or qn[sq, z] != sq):
            return False
    return True


@numba.njit(parallel=True, cache=True)
def naive_ref(pe, pn, ps, qe, qn, qs, horizon, window, replicates, seed):
    """Columns: occurrence, occupation, window, tail, total loss, tail exposure."""
    out = np.zeros((replicates, 6))
    for r in numba.prange(replicates):
        rng = _stream(seed, r)
        sp, sq = ps, qs
        tau = -1
        win = 0.0
        tail = 0.0
        for t in range(1, horizon + 1):
            if _frozen(pe, pn, qe, qn, sp, sq):
                break
            u0 = _uniform(rng)
            u1 = _uniform(rng)
            u2 = _uniform(rng)
            x, y, _ = _couple(pe[sp], qe[sq], u0, u1, u2)
            if tau < 0:
                if x != y:
                    tau = t
            elif t - tau <= window:
                win += x != y
            else:
                tail += x != y
            sp = pn[sp, x]
            sq = qn[sq, y]
        if tau > 0:
            out[r, 0] = 1.0
            out[r, 1] = horizon - tau
            out[r, 5] = max(horizon - tau - window, 0)
        out[r, 2] = win
        out[r, 3] = tail
        out[r, 4] = out[r, 0] + win + tail
    return out


@numba.njit(parallel=True, cache=True)
def rb_ref(pe, pn, ps, qe, qn, qs, horizon, window, replicates, branches, seed):
    """Columns: occurrence, occupation, window, tail, total loss, tail exposure (indicator
    variant), then window, tail, total loss of the branch-TV variant."""
    out = np.zeros((replicates, 9))
    for r in numba.prange(replicates):
        rng = _stream(seed, r)
        path_p = np.zeros(horizon, dtype=np.int64)
        path_q = np.zeros(horizon, dtype=np.int64)
        weight = np.zeros(horizon)
        # 1. overlap path with hazards h_t and weights W_{t-1} h_t
        sp, sq = ps, qs
        surv = 1.0
        n = 0
        for t in range(1, horizon + 1):
            if _frozen(pe, pn, qe, qn, sp, sq):
                break
            delta, overlap, _, _ = _stats(pe[sp], qe[sq])
            path_p[n] = sp
            path_q[n] = sq
            weight[n] = surv * delta
            n += 1
            if delta >= 1.0:
                break
            surv *= 1.0 - delta
            if t == horizon:
                break
            z = _pick(pe[sp], qe[sq], 0, _uniform(rng) * overlap)
            sp = pn[sp, z]
            sq = qn[sq, z]
        # 2. occurrence, occupation, tail exposure
        occ = 0.0
        for i in range(n):
            after = horizon - (i + 1)
            occ += weight[i]
            out[r, 1] += weight[i] * after
            out[r, 5] += weight[i] * max(after - window, 0)
        out[r, 0] = occ
        # 3. branches
        win_n = 0.0
        tail_n = 0.0
        win_tv = 0.0
        tail_tv = 0.0
        if occ > 0.0:
            for _k in range(branches):
                target = _uniform(rng) * occ
                cum = 0.0
                i0 = 0
                for i in range(n):
                    if weight[i] > 0.0:
                        i0 = i
                        cum += weight[i]
                        if cum > target:
                            break
                a = pe[path_p[i0]]
                b = qe[path_q[i0]]
                _, _, res_p, res_q = _stats(a, b)
                u1 = _uniform(rng)
                u2 = _uniform(rng)
                x = _pick(a, b, 1, u1 * res_p)
                y = _pick(a, b, 2, u2 * res_q)
                sp = pn[path_p[i0], x]
                sq = qn[path_q[i0], y]
                for lag in range(1, horizon - i0):
                    if _frozen(pe, pn, qe, qn, sp, sq):
                        break
                    u0 = _uniform(rng)
                    u1 = _uniform(rng)
                    u2 = _uniform(rng)
                    x, y, delta = _couple(pe[sp], qe[sq], u0, u1, u2)
                    if lag <= window:
                        win_n += x != y
                        win_tv += delta
                    else:
                        tail_n += x != y
                        tail_tv += delta
                    sp = pn[sp, x]
                    sq = qn[sq, y]
        # 4. estimates
        scale = occ / branches
        out[r, 2] = scale * win_n
        out[r, 3] = scale * tail_n
        out[r, 4] = occ + out[r, 2] + out[r, 3]
        out[r, 6] = scale * win_tv
        out[r, 7] = scale * tail_tv
        out[r, 8] = occ + out[r, 6] + out[r, 7]
    return out


NAIVE_COLUMNS = (
    "occurrence",
    "occupation",
    "window_contribution",
    "tail_contribution",
    "expected_mismatches",
    "tail_exposure",
)
RB_COLUMNS = (
    *NAIVE_COLUMNS,
    "window_contribution_tv",
    "tail_contribution_tv",
    "expected_mismatches_tv",
)


# The estimators a call may name (as kvcouple.synth's): "indicator" and "tv" run the same
# branches, so both return both variants' columns, as the Rust core does.
ESTIMATORS = ("naive", "indicator", "tv")


def simulate_ref(
    arrays: tuple,
    horizon: int,
    window: int,
    *,
    estimator: str | None = None,
    replicates: int,
    branches: int = 1,
    seed: int = 0,
    method: str | None = None,
) -> dict[str, np.ndarray]:
    """Per-replicate values like :func:`kvcouple.synth.simulate` (``estimator``: naive,
    indicator or tv; the last two return the columns of both). ``method=`` (with ``"rb"`` for
    ``"indicator"``) is the former keyword, read for one release with a DeprecationWarning."""
    if method is not None:
        warn_renamed("method", "estimator", "simulate_ref")
        if estimator is not None and estimator != method:
            raise ValueError("give estimator= or the deprecated method=, not both")
        estimator = "indicator" if method == "rb" else method
    pe, pn, ps, qe, qn, qs = arrays
    args = (pe, pn, int(ps), qe, qn, int(qs), int(horizon), int(window), int(replicates))
    if estimator == "naive":
        out = naive_ref(*args, np.uint64(seed))
        return dict(zip(NAIVE_COLUMNS, out.T, strict=True))
    if estimator in ("indicator", "tv"):
        out = rb_ref(*args, int(branches), np.uint64(seed))
        return dict(zip(RB_COLUMNS, out.T, strict=True))
    raise ValueError(f"unknown estimator {estimator!r}: use one of {', '.join(ESTIMATORS)}")
