"""Issue 24, points 3 and 4: chunk checksums (schema version 3) and value checks on what
decodes. Damage is made the way it happens: a byte flipped on disk (the checksum catches it),
or values edited with zarr-python (the chunk is re-encoded with a valid checksum, so only the
value checks can catch it). Every refusal names the variable, the chunk, the document and the
element, from ``analyze`` (through the Rust store engine and through zarr-python) and from
``info --check``; ``--allow-incomplete`` skips just the damaged document."""

from __future__ import annotations

import contextlib
import json
import re
import shutil

import numpy as np
import pytest
import xarray as xr
import zarr

from kvcouple.analysis import analyze
from kvcouple.cli import main
from kvcouple.errors import StoreError
from kvcouple.store import SCHEMA_VERSION
from kvcouple.store.reader import TraceStoreReader
from kvcouple.store.schema import CHECKSUMS_SINCE, row_sum_tolerance
from kvcouple.synth.trace_store import write_synthetic_trace_store
from store_helpers import set_root_attr

PAIRS = {
    "a": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.7 + 0.3 * np.eye(5), "start": 0},
    "b": {"P": np.full((5, 5), 0.2), "Q": np.full((5, 5), 0.2) * 0.4 + 0.6 * np.eye(5), "start": 1},
}
ENGINES = ["auto", "zarr"]  # the Rust store engine (zarrs) and the zarr-python path
# zarr-python 3 writes Zarr format 3 with crc32c; zarr-python 2 format 2 with zstd checksums.
ZARR3 = int(zarr.__version__.split(".")[0]) >= 3
KIND = "crc32c" if ZARR3 else "zstd checksum"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("integrity") / "run.zarr"
    return write_synthetic_trace_store(
        path, PAIRS, horizon=6, branches=2, replicates=4, docs=3, record="full", seed=3
    )


@pytest.fixture
def copy(store, tmp_path):
    dst = tmp_path / "copy.zarr"
    shutil.copytree(store, dst)
    return dst


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    monkeypatch.setenv("KVCOUPLE_STORE_ENGINE", request.param)
    return request.param


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def refused(path, tmp_path, capsys, pattern, doc_id="doc0001"):
    """analyze refuses naming ``pattern`` (no numbers, exit 2), ``--allow-incomplete`` skips
    just ``doc_id`` with that reason, and ``info --check`` lists it."""
    with pytest.raises(StoreError, match=pattern):
        analyze(path, n_boot=20)
    result = analyze(path, n_boot=20, allow_incomplete=True)
    assert [s["doc_id"] for s in result.skipped] == [doc_id]
    assert re.search(pattern, result.skipped[0]["reason"])
    assert len(result.models[0].docs) == 2
    capsys.readouterr()
    assert main(["analyze", str(path), "--out", str(tmp_path / "r"), "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "E[M]/T" not in err
    assert re.search(pattern, err), err
    assert main(["info", str(path), "--check"]) == 1
    assert re.search(pattern, capsys.readouterr().out)


# -- checksums ------------------------------------------------------------------------------


def test_new_stores_carry_a_checksum_on_every_chunk(store, capsys):
    reader = TraceStoreReader(store)
    assert reader.attrs["schema_version"] == SCHEMA_VERSION >= CHECKSUMS_SINCE
    assert reader.checksums == f"{KIND} on every chunk"
    group = zarr.open_group(str(store), mode="r")
    for name in [*reader.variables, "doc_id", "policy", "doc", "step"]:
        if ZARR3:
            codecs = json.loads((store / name / "zarr.json").read_text())["codecs"]
            assert codecs[-1] == {"name": "crc32c"}, (name, codecs)
            assert group[name].metadata.zarr_format == 3
        else:
            compressor = json.loads((store / name / ".zarray").read_text())["compressor"]
            assert compressor["id"] == "zstd" and compressor["checksum"] is True, name
    assert main(["info", str(store)]) == 0
    assert f"checksums {KIND} on every chunk" in capsys.readouterr().out
    # Plain xarray reads the same values (zeros included: no fill value taken for a mask).
    ds = xr.open_zarr(str(store))
    for name in ("hazard", "tokens", "branch_mismatch", "p", "kept_length"):
        np.testing.assert_array_equal(ds[name].values, group[name][...])


@pytest.mark.parametrize(
    "name, key",
    [
        ("hazard", "hazard/1.0.0.0"),  # a summary variable, read by the engine (or zarr-python)
        ("p", "p/1.1.0.0.0"),  # a distribution, read by the engine (or zarr-python)
        ("branch_q", "branch_q/1.0.0.0.0.0"),
    ],
)
def test_a_flipped_byte_is_refused_naming_the_chunk(copy, tmp_path, capsys, engine, name, key):
    flip_byte(copy / key)
    # A flipped byte inside a Zstd frame may break the frame before its checksum is reached.
    why = ": it fails its checksum" if ZARR3 else ""
    refused(
        copy,
        tmp_path,
        capsys,
        rf"chunk {key} of variable '{name}' \(document 'doc0001'\) cannot be decoded{why}",
    )


@pytest.mark.skipif(not ZARR3, reason="labels are checksummed by crc32c (Zarr format 3)")
def test_a_flipped_byte_in_a_label_chunk_is_refused(copy):
    flip_byte(copy / "doc_id" / "0")
    with pytest.raises(
        StoreError,
        match=r"chunk doc_id/0 of variable 'doc_id' cannot be decoded: it fails its checksum",
    ):
        TraceStoreReader(copy)


def old_store(src, dst):
    """A store as kvcouple wrote it before checksums: Zarr format 2, Zstd, no checksum codec,
    schema version 2 (re-written with xarray, the codecs dropped, and the version set back)."""
    ds = xr.open_zarr(str(src))
    for v in ds.variables.values():
        v.encoding = {}
    kw = {"zarr_format": 2} if ZARR3 else {}
    ds.to_zarr(str(dst), mode="w", consolidated=True, write_empty_chunks=True, **kw)
    set_root_attr(dst, "schema_version", 2)
    return dst


def test_old_stores_without_checksums_still_analyse(store, tmp_path, capsys, engine):
    old = old_store(store, tmp_path / "old.zarr")
    reader = TraceStoreReader(old)
    assert reader.schema_version == 2
    assert reader.checksums == "no checksums (schema version 2)"
    new, before = analyze(store, n_boot=50, seed=1), analyze(old, n_boot=50, seed=1)
    assert before.settings["store_checksums"] == {str(old): "no checksums (schema version 2)"}
    assert new.settings["store_checksums"] == {str(store): f"{KIND} on every chunk"}
    assert [r["estimate"] for r in before.models[0].tables["summary"]] == [
        r["estimate"] for r in new.models[0].tables["summary"]
    ]
    checked = [d.check for d in before.models[0].docs]
    assert all(c is not None and c.rows_checked > 0 and not c.disagreements for c in checked)
    assert main(["info", str(old), "--check"]) == 0
    out = capsys.readouterr().out
    assert "schema v2" in out and "checksums no checksums (schema version 2)" in out
    report = tmp_path / "r"
    assert main(["analyze", str(old), "--out", str(report), "--no-figures", "--n-boot", "20"]) == 0
    assert "has no checksums (schema version 2)" in capsys.readouterr().err
    meta = json.loads((report / "results.json").read_text())["meta"]
    assert meta["store_checksums"] == {str(old): "no checksums (schema version 2)"}
    assert "no checksums (schema version 2)" in (report / "report.md").read_text()
    # Value checks still apply to old stores: only the checksum is missing.
    zarr.open_group(str(old), mode="r+")["kl_pq"][2, 0, 1, 1] = -0.5
    with pytest.raises(StoreError, match=r"variable 'kl_pq' \(document 'doc0002'\) holds -0\.5"):
        analyze(old, n_boot=20)


@pytest.mark.skipif(not ZARR3, reason="writes Zarr format 3")
@pytest.mark.filterwarnings("ignore:Consolidated metadata")
def test_a_store_rewritten_without_checksums_says_so(store, tmp_path):
    dst = tmp_path / "v3.zarr"
    ds = xr.open_zarr(str(store))
    for v in ds.variables.values():
        v.encoding = {}
    ds.to_zarr(str(dst), mode="w", consolidated=True, zarr_format=3)
    assert TraceStoreReader(dst).checksums == "no checksums (re-written without them)"


def test_resuming_an_old_store_is_refused(store, tmp_path):
    old = old_store(store, tmp_path / "old.zarr")
    with pytest.raises(
        StoreError, match=f"schema version 2; this kvcouple writes version {SCHEMA_VERSION}"
    ):
        write_synthetic_trace_store(
            old, PAIRS, horizon=6, branches=2, replicates=4, docs=3, record="full", seed=3
        )


# -- value checks ---------------------------------------------------------------------------


def edit(path, name, index, value):
    """Write ``value`` at ``index`` of ``name`` with zarr-python (a valid chunk and checksum;
    kept even where it equals the fill value, which zarr would otherwise delete)."""
    config = getattr(zarr, "config", None)  # zarr 2 always writes every chunk
    with config.set({"array.write_empty_chunks": True}) if config else contextlib.nullcontext():
        zarr.open_group(str(path), mode="r+")[name][index] = value


def test_nan_in_a_stored_row_is_refused(copy, tmp_path, capsys, engine):
    edit(copy, "p", (1, 0, 2, 3, 1), np.nan)
    refused(
        copy,
        tmp_path,
        capsys,
        r"chunk p/1\.0\.0\.0\.0 of variable 'p' \(document 'doc0001'\) holds nan at "
        r"\(1, 0, 2, 3, 1\); values must be finite and >= 0 in a recorded row",
    )


def test_negative_entry_in_a_branch_row_is_refused(copy, tmp_path, capsys, engine):
    row = zarr.open_group(str(copy), mode="r")["branch_q"][1, 1, 0, 0, 0]
    row[0], row[1] = -row[1], row[0] + 2 * row[1]  # still sums to 1
    edit(copy, "branch_q", (1, 1, 0, 0, 0), row)
    refused(
        copy,
        tmp_path,
        capsys,
        r"chunk branch_q/1\.1\.0\.0\.0\.0 of variable 'branch_q' \(document 'doc0001'\) holds "
        r"-0\.\d+ at \(1, 1, 0, 0, 0, 0\); values must be finite and >= 0",
    )


def test_a_row_not_summing_to_one_is_refused(copy, tmp_path, capsys, engine):
    g = zarr.open_group(str(copy), mode="r")
    row = g["q"][1, 1, 3, 2].astype(np.float64)
    edit(copy, "q", (1, 1, 3, 2), (0.9 * row).astype(np.float16))
    refused(
        copy,
        tmp_path,
        capsys,
        r"chunk q/1\.1\.0\.0\.0 of variable 'q' \(document 'doc0001'\) holds a row at "
        r"\(1, 1, 3, 2\); values must be rows summing to 1 within 0\.0005 \(this row sums to "
        r"0\.9\d*\)",
    )


@pytest.mark.parametrize(
    "name, index, value, allowed",
    [
        ("kl_pq", (1, 0, 2, 1), -0.5, r">= 0 \(\+inf where the supports differ\)"),
        ("entropy_q", (1, 1, 0, 5), -1.0, r"finite and >= 0"),
        ("entropy_p", (1, 0, 2, 1), np.inf, r"finite and >= 0"),
        ("kl_qp", (1, 0, 2, 1), -np.inf, r">= 0 \(\+inf where the supports differ\)"),
        ("branch_tv", (1, 0, 2, 1, 0), -np.inf, r"finite and in \[0, 1\]"),
        ("prompt_length", (1,), -3, r">= 1"),
        ("prompt_length", (1,), 0, r">= 1"),
        ("kept_length", (1, 1), 0, r"in \[1, 1\] \(the document.s prompt_length\)"),
        ("kept_length", (1, 0), 7, r"in \[1, 1\] \(the document's prompt_length\)"),
    ],
)
def test_divergences_and_lengths_out_of_range_are_refused(
    copy, tmp_path, capsys, name, index, value, allowed
):
    edit(copy, name, index, value)
    # One chunk per document and policy: the key is the index's first two entries, then 0s.
    key = ".".join(map(str, (*index[:2], *[0] * (len(index) - 2))))
    shown = f"{value!r}".replace(".", r"\.")
    refused(
        copy,
        tmp_path,
        capsys,
        rf"chunk {name}/{key} of variable '{name}' \(document 'doc0001'\) holds {shown} at "
        rf"\({', '.join(map(str, index))}\); values must be {allowed}",
    )


def test_a_tiny_negative_divergence_from_float_noise_is_allowed(copy):
    edit(copy, "kl_qp", (1, 0, 2, 1), -2e-5)
    analyze(copy, n_boot=20)  # no error


@pytest.mark.parametrize(
    "name, index, shown, mark",
    [
        ("p", (1, 0, 2, 3), "a row of NaN", "tokens"),
        ("q", (1, 1, 0, 0), "a row of NaN", "tokens"),
        ("branch_p", (1, 0, 1, 0, 0), "a row of NaN", "branch_mismatch"),
        ("entropy_p", (1, 0, 2, 3), "nan", "tokens"),
    ],
)
def test_nan_where_something_was_recorded_is_refused(
    copy, tmp_path, capsys, engine, name, index, shown, mark
):
    """A NaN (a whole row of a distribution: the engine's row check allows it as "not
    recorded") where the path or branch was recorded is damage, named by variable, document
    and index, on both engines; it was analysed without a word before (issue 36)."""
    group = zarr.open_group(str(copy), mode="r")
    marks = group[mark][index[:2]][index[2 : 2 + group[mark].ndim - 2]]
    assert np.all(marks != -1)  # recorded there
    arr = group[name]
    value = np.full(arr.shape[len(index) :], np.nan, arr.dtype) if shown != "nan" else np.nan
    edit(copy, name, index, value)
    key = ".".join(map(str, (*index[:2], *[0] * (arr.ndim - 2))))
    refused(
        copy,
        tmp_path,
        capsys,
        rf"chunk {name}/{key} of variable '{name}' \(document 'doc0001'\) holds {shown} at "
        rf"\({', '.join(map(str, index))}\); values must be not NaN where {mark} was recorded",
    )


def test_nan_in_the_hazard_is_refused(copy, tmp_path, capsys):
    edit(copy, "hazard", (1, 0, 2, 3), np.nan)
    refused(
        copy, tmp_path, capsys,
        r"variable 'hazard' \(document 'doc0001'\) holds nan at \(1, 0, 2, 3\); values must "
        r"be finite \(NaN is never written to it\)",
    )  # fmt: skip


def test_nan_where_nothing_was_recorded_is_allowed(tmp_path):
    """After a path ends (a step with hazard 1: tokens -1, metrics NaN) and past the horizon
    in the branches (branch_mismatch -1, rows of NaN) NaN means "not recorded"."""
    pairs = {"a": {"P": np.eye(3), "Q": np.roll(np.eye(3), 1, axis=1), "start": 0}}
    path = write_synthetic_trace_store(
        tmp_path / "s.zarr",
        pairs,
        horizon=4,
        window=4,
        branches=1,
        replicates=2,
        docs=1,
        record="full",
    )
    group = zarr.open_group(str(path), mode="r")
    assert np.isnan(group["entropy_p"][0, 0, 0, 1:]).all()  # the path ended at step 1
    past = group["branch_mismatch"][0, 0] == -1  # past the horizon, or no branch
    assert past.any() and np.isnan(group["branch_p"][0, 0][past]).all()
    analyze(path, n_boot=20)  # no error
    assert main(["info", str(path), "--check"]) == 0


def test_row_sum_tolerance_is_the_float16_rounding_of_the_entries():
    """u + V x (subnormal spacing / 2) + 2^-17: float16 rows of real softmaxes lie within it
    at a 128k vocabulary, a row missing 1% of its mass does not."""
    vocab = 128_256
    tol = row_sum_tolerance("float16", vocab)
    assert tol == pytest.approx(2.0**-11 + vocab * 2.0**-25 + 2.0**-17)
    assert 4e-3 < tol < 5e-3
    rng = np.random.default_rng(0)
    for scale in (0.5, 3.0, 12.0):  # flat to peaked distributions
        logits = rng.normal(0, scale, vocab).astype(np.float32)
        p = np.exp(logits - logits.max())
        p = (p / p.sum()).astype(np.float16)
        err = abs(float(p.sum(dtype=np.float64)) - 1.0)
        assert err <= tol, (scale, err, tol)
        assert abs(float((0.99 * p.astype(np.float64)).sum()) - 1.0) > tol
    assert row_sum_tolerance("float16", 5) == pytest.approx(2.0**-11 + 5 * 2.0**-25 + 2.0**-17)
    assert row_sum_tolerance("bfloat16", vocab) == pytest.approx(2.0**-8, rel=1e-2)


@pytest.mark.skipif(ZARR3, reason="zarr-python 2 only: Zarr format 2 with zstd checksums")
def test_zarr2_without_zstd_checksums_refuses_to_write(tmp_path, monkeypatch):
    import numcodecs

    class OldZstd:  # numcodecs < 0.13: no checksum flag
        def __init__(self, level: int = 1):
            self.level = level

    monkeypatch.setattr(numcodecs, "Zstd", OldZstd)
    with pytest.raises(StoreError, match=r"needs numcodecs >= 0\.13 \(zstd checksums"):
        write_synthetic_trace_store(tmp_path / "s.zarr", PAIRS, horizon=3, replicates=2)
    assert not (tmp_path / "s.zarr").exists()
