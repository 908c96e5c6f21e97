#!/usr/bin/env python3
"""Curated mutation testing of the Python side: plausible bugs, applied one at a time.

Each mutant below is a small textual patch that looks like a real mistake (a swapped term, an
off-by-one lag, a ratio of means turned into a mean of ratios, a flag written too early). For
each, the script applies the patch, runs the pytest files that should notice, and restores the
file (also on Ctrl-C). A mutant is *killed* when those tests fail, *survived* when they pass,
*timeout* when they run past ``--timeout``, and *stale* when its patch no longer matches the
code (the code moved: update the table). Exit status 1 if any survived or went stale.

    python scripts/mutants.py              # every mutant (``make mutants`` runs this)
    python scripts/mutants.py --list       # the table
    python scripts/mutants.py E1 S2        # some of them

The Rust core is mutated by cargo-mutants instead (see ``make mutants``); the Rust kernels seen
from Python are mutated here only through the numba reference they are tested against.
Not run in CI: it runs each test file once per mutant (about 10 minutes on two cores).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "python/kvcouple"

ANALYSIS = [
    "tests/analysis/test_analysis_synthetic.py",
    "tests/analysis/test_analysis_exact_aggregates.py",
]
PLAN = ["tests/analysis/test_analysis_plan.py"]
# The per-unit estimates are Rust's; the numpy reference is held to them here.
REFERENCE = ["tests/analysis/test_unit_estimates_reference.py"]
STORE = ["tests/store/test_store_faults.py", "tests/analysis/test_analysis_store.py"]
REPORT = ["tests/analysis/test_document_files.py"]
MEMORY = ["tests/analysis/test_memory.py"]
MOMENTS = ["tests/analysis/test_running_moments.py"]
POLICIES = ["tests/tracer/test_policies.py"]
KERNELS = ["tests/kernels/test_kernels.py", "tests/kernels/test_coupling.py"]
TORCH_COUPLING = ["tests/kernels/test_torch_coupling.py"]


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to python/kvcouple
    patches: tuple[tuple[str, str], ...]  # (old, new); each old must occur exactly once
    tests: tuple[str, ...]
    what: str


def m(id: str, file: str, what: str, tests: list[str], *patches: tuple[str, str]) -> Mutant:
    return Mutant(id, file, tuple(patches), tuple(tests), what)


MUTANTS = [
    # --- per-(document, policy) estimators: the numpy reference (reference/estimates.py),
    # which the Rust-vs-reference test (tests/analysis/test_unit_estimates_reference.py)
    # must catch; the Rust implementation (rust/core/src/stats/units.rs) is cargo-mutants'.
    m(
        "E1",
        "reference/estimates.py",
        "RB-CMC weights W_t instead of W_{t-1}",
        REFERENCE,
        ("    return w, w_prev * h", "    return w, w * h"),
    ),
    m(
        "E2",
        "reference/estimates.py",
        "window lags shifted by one (0..L_w-1 instead of 1..L_w)",
        REFERENCE,
        (
            "per_lag[:, :, 1 : obs_window + 1].sum(2)",
            "per_lag[:, :, 0:obs_window].sum(2)",
        ),
        ("per_lag[:, :, obs_window + 1 :].sum(2)", "per_lag[:, :, obs_window:].sum(2)"),
    ),
    m(
        "E3",
        "reference/estimates.py",
        "occupation counts step t itself: (T - t + 1)",
        REFERENCE,
        ('"occupation": mass @ (T - steps),', '"occupation": mass @ (T - steps + 1),'),
    ),
    m(
        "E4",
        "reference/estimates.py",
        "tail exposure off by one lag",
        REFERENCE,
        ("np.maximum(T - steps - obs_window, 0.0)", "np.maximum(T - steps - obs_window - 1, 0.0)"),
    ),
    m(
        "E5",
        "reference/estimates.py",
        "mean divergence time counts from 0",
        REFERENCE,
        ('"tau_mass": mass @ steps,', '"tau_mass": mass @ (steps - 1),'),
    ),
    m(
        "E6",
        "reference/estimates.py",
        "unobserved mismatch (-1) counted as a mismatch",
        REFERENCE,
        (
            "np.maximum(np.asarray(branch_mismatch, np.float64), 0.0)",
            "np.abs(np.asarray(branch_mismatch, np.float64))",
        ),
    ),
    m(
        "E7",
        "reference/estimates.py",
        "branches summed instead of averaged",
        REFERENCE,
        (
            "win = per_lag[:, :, 1 : obs_window + 1].sum(2).mean(1)",
            "win = per_lag[:, :, 1 : obs_window + 1].sum(2).sum(1)",
        ),
    ),
    m(
        "E8",
        "reference/estimates.py",
        "survival curve shifted (W_{t-1} for W_t)",
        REFERENCE,
        (
            "survival = np.concatenate([[1.0], w.mean(0)])",
            "survival = np.concatenate([[1.0], w_prev.mean(0)])",
        ),
    ),
    m(
        "E9",
        "reference/estimates.py",
        "median divergence time off by one",
        REFERENCE,
        ("return float(dc.median_step(pmf))", "return float(dc.median_step(pmf)) - 1.0"),
    ),
    m(
        "E10",
        "reference/estimates.py",
        "branch TV denominator summed over branches",
        REFERENCE,
        ("den = (reached.mean(1) * weight)", "den = (reached.sum(1) * weight)"),
    ),
    # --- across-document statistics (analysis/quantities.py, stats.py, units.py, pvalues.py) ----
    m(
        "S1",
        "analysis/quantities.py",
        "rho over the occurrence instead of the occupation",
        ANALYSIS,
        (
            'dc.rho(c("post_mismatches"), c("occupation"))',
            'dc.rho(c("post_mismatches"), c("occurrence"))',
        ),
    ),
    m(
        "S2",
        "analysis/quantities.py",
        "first_mismatch and exposure swapped",
        ANALYSIS,
        ('dc.first_mismatch(c("occurrence"), T)', 'dc.first_mismatch(c("occupation"), T)'),
        ('dc.exposure(c("occupation"), T)', 'dc.exposure(c("occurrence"), T)'),
    ),
    m(
        "S3",
        "analysis/quantities.py",
        "E[M]/T divided by T - 1",
        ANALYSIS,
        (
            'dc.mismatch_fraction(c("expected_mismatches"), T)',
            'dc.mismatch_fraction(c("expected_mismatches"), T - 1)',
        ),
    ),
    m(
        "S4",
        "analysis/stats.py",
        "gap attribution: exposure term with policy A's rate only",
        ANALYSIS + PLAN,
        ('"exposure_term": 0.5 * (ra + rb) * (eb - ea),', '"exposure_term": ra * (eb - ea),'),
    ),
    m(
        "S5",
        "analysis/stats.py",
        "gap attribution: rate term with policy A's exposure only",
        ANALYSIS + PLAN,
        ('"rate_term": 0.5 * (ea + eb) * (rb - ra),', '"rate_term": ea * (rb - ra),'),
    ),
    m(
        "S6",
        "analysis/stats.py",
        "hazard curve divides by S_t instead of S_{t-1}",
        ANALYSIS,
        (
            '_column_ratio(f"{policy}|pmf|{t}", f"{policy}|S|{t - 1}")',
            '_column_ratio(f"{policy}|pmf|{t}", f"{policy}|S|{t}")',
        ),
    ),
    m(
        "S7",
        "analysis/units.py",
        "early window starts at lag 0 (a batch of documents' rows)",
        ANALYSIS,
        (
            "len(batch.policies)\n        early = slice(1, self.split + 1)",
            "len(batch.policies)\n        early = slice(0, self.split + 1)",
        ),
    ),
    m(
        "S9",
        "analysis/pvalues.py",
        "bootstrap p-value without the +1 correction",
        PLAN,
        ("le = (1 + np.sum(b <= value)) / (b.size + 1)", "le = np.sum(b <= value) / b.size"),
    ),
    m(
        "S10",
        "analysis/pvalues.py",
        "Holm multiplier off by one",
        PLAN,
        ("min(1.0, (len(p) - rank) * p[i])", "min(1.0, (len(p) - rank - 1) * p[i])"),
    ),
    m(
        "S11",
        "analysis/quantities.py",
        "mean divergence time divided by T instead of the occurrence",
        ANALYSIS,
        ('dc.ratio(c("tau_mass"), c("occurrence"))', 'c("tau_mass") / T'),
    ),
    # --- the report's files (analysis/report.py, analysis/engine.py) -------------------------
    m(
        "R1",
        "analysis/report.py",
        "a failed analysis's per-document files left in the output folder",
        REPORT,
        (
            "        for part in self._parts.values():\n            part.unlink(missing_ok=True)\n",
            "        for part in self._parts.values():\n            pass\n",
        ),
    ),
    m(
        "R2",
        "analysis/engine.py",
        "the statistics on the caller's BLAS threads",
        REPORT,
        (
            '    with threadpool_limits(1, user_api="blas"):\n        return [_model_result(',
            "    with contextlib.nullcontext():\n        return [_model_result(",
        ),
    ),
    # --- how an analysis runs (analysis/memory.py) and what it counts as it reads ------------
    m(
        "H1",
        "analysis/memory.py",
        "numpy's huge-page advice left off after the analysis",
        MEMORY,
        (
            "            if _depth == 0:\n                _SWITCH(_before)",
            "            if _depth < 0:\n                _SWITCH(_before)",
        ),
    ),
    m(
        "H2",
        "analysis/memory.py",
        "the user's NUMPY_MADVISE_HUGEPAGE overridden",
        MEMORY,
        ("if _SWITCH is None or HUGEPAGE_ENV in os.environ:", "if _SWITCH is None:"),
    ),
    m(
        "C1",
        "analysis/moments.py",
        "the curves' documents counted where an entry is 0 too",
        MOMENTS,
        (
            "        self.positive += (block > 0).sum(0)",
            "        self.positive += (block >= 0).sum(0)",
        ),
    ),
    m(
        "C2",
        "analysis/stats.py",
        "the curves' documents: every finite entry instead of the positive ones",
        MOMENTS,
        ("        return bs.moments.positive", "        return bs.moments.count.astype(np.int64)"),
    ),
    # --- store writer (store/writer.py) -----------------------------------------------------
    m(
        "W1",
        "store/writer.py",
        "completed flag written before the document's data",
        STORE,
        (
            "            for name, value in values.items():\n"
            "                self._array(name)[doc] = value\n"
            '            self._array("completed")[doc] = True',
            '            self._array("completed")[doc] = True\n'
            "            for name, value in values.items():\n"
            "                self._array(name)[doc] = value",
        ),
    ),
    m(
        "W1s",
        "store/writer.py",
        "a shard's completed flags written before its documents' data",
        STORE + ["tests/store/test_store_sharding.py"],
        (
            'for name, values in [*held.arrays.items(), ("completed", flags)]:',
            'for name, values in [("completed", flags), *held.arrays.items()]:',
        ),
    ),
    m(
        "W2",
        "store/resume.py",
        "resume accepts a store made with other settings",
        STORE + ["tests/analysis/test_analysis_consistency.py"],
        ("        if old == new:\n            continue", "        if True:\n            continue"),
    ),
    m(
        "W3",
        "store/writer.py",
        "write_doc accepts arrays of the wrong shape",
        STORE,
        ("            if value.shape != want:", "            if value.ndim != len(want):"),
    ),
    # --- policies ---------------------------------------------------------------------------
    m(
        "P1",
        "policies/snapkv.py",
        "SnapKV without the GQA group mean (first head of each group)",
        POLICIES,
        ("        return ctx.group_mean(pooled)", "        return pooled[:: ctx.group_size]"),
    ),
    m(
        "P2",
        "policies/h2o.py",
        "H2O recent share rounded down",
        POLICIES,
        ('int(self.params["recent"] * keep + 0.5)', 'int(self.params["recent"] * keep)'),
    ),
    m(
        "P3",
        "policies/knorm.py",
        "K-norm keeps the largest keys",
        POLICIES,
        (
            "return -ctx.keys[layer].float().norm(dim=-1)",
            "return ctx.keys[layer].float().norm(dim=-1)",
        ),
    ),
    m(
        "P4",
        "policies/valuediff.py",
        "value deviation from the mean over heads, not positions",
        POLICIES,
        ("v.mean(dim=1, keepdim=True)", "v.mean(dim=0, keepdim=True)"),
    ),
    m(
        "P5",
        "policies/tova.py",
        "TOVA scores with the second-to-last query",
        POLICIES,
        ("ctx.window_attention(layer, 1)[:, -1]", "ctx.window_attention(layer, 2)[:, 0]"),
    ),
    m(
        "P6",
        "policies/base.py",
        "kept count rounds half to even",
        POLICIES,
        ("want = math.floor(retain * length + 0.5)", "want = round(retain * length)"),
    ),
    m(
        "P7",
        "policies/base.py",
        "streaming sinks start at position 1",
        POLICIES,
        ("idx = torch.cat([torch.arange(first), ", "idx = torch.cat([torch.arange(1, first + 1), "),
    ),
    m(
        "P8",
        "policies/snapkv.py",
        "SnapKV observation window one token early",
        POLICIES,
        (
            "tail = torch.arange(n - window, n, device=device)",
            "tail = torch.arange(n - window - 1, n - 1, device=device)",
        ),
    ),
    m(
        "P9",
        "policies/context.py",
        "attention mask lets queries see the next key",
        POLICIES,
        ("masked_fill(key_pos > query_pos,", "masked_fill(key_pos > query_pos + 1,"),
    ),
    # --- reference kernels and the torch sampler --------------------------------------------
    m(
        "K1",
        "reference/kernels.py",
        "reference top-1 takes the last maximal index",
        KERNELS,
        ("            if a > best_p:", "            if a >= best_p:"),
    ),
    m(
        "K2",
        "reference/kernels.py",
        "reference coupling: identical rows may take the residual at u0 = 0",
        KERNELS,
        ("        if u[r, 0] >= delta and o > 0.0:", "        if u[r, 0] > delta and o > 0.0:"),
    ),
    m(
        "K3",
        "reference/kernels.py",
        "reference KL terms swapped",
        KERNELS,
        (
            "kl_pq += a * (math.log(a) - math.log(b))",
            "kl_pq += b * (math.log(b) - math.log(a))",
        ),
    ),
    m(
        "K4",
        "torch_coupling.py",
        "torch sampler: residual branch at u0 == delta",
        TORCH_COUPLING,
        ("use_overlap = (u[:, 0] >= delta)", "use_overlap = (u[:, 0] > delta)"),
    ),
    m(
        "K5",
        "torch_coupling.py",
        "torch inverse CDF: first index reaching (not exceeding) the target",
        TORCH_COUPLING,
        ("idx = (cum <= target.unsqueeze(-1))", "idx = (cum < target.unsqueeze(-1))"),
    ),
    m(
        "K6",
        "torch_coupling.py",
        "torch sampler: the P residual is q - p",
        TORCH_COUPLING,
        ("res_p_w = d.clamp(min=0.0)", "res_p_w = (-d).clamp(min=0.0)"),
    ),
]


def run_tests(tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """'passed', 'failed' or 'timeout', seconds, last output lines."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # no mutant bytecode left behind
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-3:])
    return ("passed" if r.returncode == 0 else "failed"), time.monotonic() - start, tail


def apply(mutant: Mutant) -> tuple[Path, str, int] | None:
    """Write the mutant; returns (path, original text, original mtime) or None if stale."""
    path = ROOT / PKG / mutant.file
    text = path.read_text()
    new = text
    for old, repl in mutant.patches:
        if new.count(old) != 1:
            return None
        new = new.replace(old, repl)
    mtime = path.stat().st_mtime_ns
    path.write_text(new)
    return path, text, mtime


def restore(path: Path, text: str, mtime: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime, mtime))  # the original's cached bytecode stays valid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="mutant ids (default: all)")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    args = parser.parse_args()
    chosen = [x for x in MUTANTS if not args.ids or x.id in args.ids]
    unknown = set(args.ids) - {x.id for x in MUTANTS}
    if unknown:
        parser.error(f"unknown mutant ids: {', '.join(sorted(unknown))}")
    if args.list:
        for x in chosen:
            print(f"{x.id:4} {x.file:24} {x.what}  [{' '.join(x.tests)}]")
        return 0

    # A mutant killed by tests that already fail unmutated proves nothing.
    if not args.no_baseline:
        files = tuple(sorted({t for x in chosen for t in x.tests}))
        status, secs, tail = run_tests(files, args.timeout * 2)
        print(f"baseline ({len(files)} test files): {status} in {secs:.0f} s", flush=True)
        if status != "passed":
            print(tail)
            return 2

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    results: dict[str, list[str]] = {"killed": [], "survived": [], "timeout": [], "stale": []}
    for x in chosen:
        applied = apply(x)
        if applied is None:
            outcome, secs = "stale", 0.0
        else:
            try:
                status, secs, _ = run_tests(x.tests, args.timeout)
            finally:
                restore(*applied)
            outcome = {"failed": "killed", "passed": "survived"}.get(status, status)
        results[outcome].append(x.id)
        print(f"{outcome:8} {x.id:4} {x.file:24} {x.what} ({secs:.0f} s)", flush=True)

    tried = len(chosen) - len(results["stale"])
    caught = len(results["killed"]) + len(results["timeout"])
    score = 100.0 * caught / tried if tried else 0.0
    print(
        f"\nmutation score {caught}/{tried} ({score:.0f}%): killed {len(results['killed'])}, "
        f"timeout {len(results['timeout'])}, survived {len(results['survived'])} "
        f"{results['survived'] or ''}, stale {len(results['stale'])} {results['stale'] or ''}"
    )
    return 1 if results["survived"] or results["stale"] else 0


if __name__ == "__main__":
    sys.exit(main())
