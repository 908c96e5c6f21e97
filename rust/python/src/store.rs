//! The trace-store engine (`kvcouple-store`): decode and recompute in one parallel pass.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kvcouple_core::rows::Dtype;
use kvcouple_store::chunks::{decode_runs, Chunk};
use kvcouple_store::fetched::{chunks_tv, FetchedVariable};
use kvcouple_store::local::{blocks_tv, LocalVariable};
use kvcouple_store::source::{ChunkSource, FetchedObjects, LocalFiles};
use kvcouple_store::{BlockOutput, Problem};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;

use crate::errors::{InternalError, InvalidInputError, ShapeError};

/// `(kind, key, message)` of a failed read: kind is "missing", "decode", "checksum",
/// "unsupported" or "value" (then message is `what;i0,i1,...;value`, `what` "entry" or "sum",
/// for the reader to word like its own value checks).
type ProblemTuple = (String, String, String);

fn as_tuple(p: Problem) -> ProblemTuple {
    match p {
        Problem::Missing { key } => ("missing".into(), key, String::new()),
        Problem::Decode { key, message } => ("decode".into(), key, message),
        Problem::Checksum { key, message } => ("checksum".into(), key, message),
        Problem::Unsupported { message } => ("unsupported".into(), String::new(), message),
        Problem::Value {
            key,
            index,
            value,
            what,
        } => {
            let at: Vec<String> = index.iter().map(|i| i.to_string()).collect();
            (
                "value".into(),
                key,
                format!("{what};{};{value:?}", at.join(",")),
            )
        }
    }
}

fn parse_kind(dtype: &str) -> PyResult<Dtype> {
    match dtype {
        "float16" => Ok(Dtype::F16),
        "bfloat16" => Ok(Dtype::BF16),
        "float32" => Ok(Dtype::F32),
        "float64" => Ok(Dtype::F64),
        other => Err(InvalidInputError::new_err(format!(
            "unsupported dtype {other:?}: use float16, bfloat16, float32 or float64"
        ))),
    }
}

/// The rows' format and `blocks[i, axis] = (start, stop)` as ranges (and the tolerance
/// checked).
fn parse_blocks(
    blocks: &PyReadonlyArray3<'_, i64>,
    dtype: &str,
    row_tolerance: Option<f64>,
) -> PyResult<(Dtype, Vec<Vec<Range<u64>>>)> {
    let kind = parse_kind(dtype)?;
    let shape = blocks.shape().to_vec();
    if shape[2] != 2 {
        return Err(ShapeError::new_err("blocks must have shape (n, ndim, 2)"));
    }
    let flat = blocks
        .as_slice()
        .map_err(|_| ShapeError::new_err("blocks must be C-contiguous"))?;
    if row_tolerance.is_some_and(|t| t.is_nan() || t < 0.0) {
        return Err(InvalidInputError::new_err(
            "row_tolerance must be a number >= 0",
        ));
    }
    if flat.iter().any(|&v| v < 0) {
        return Err(InvalidInputError::new_err("block bounds must be >= 0"));
    }
    let ranges = flat
        .chunks_exact((shape[1] * 2).max(1))
        .map(|b| {
            b.chunks_exact(2)
                .map(|r| r[0] as u64..r[1] as u64)
                .collect()
        })
        .collect();
    Ok((kind, ranges))
}

/// `read` run with the GIL released: its result, or its problem as a tuple (store damage is
/// named by the reader, not raised here); a panic is raised as an internal error.
fn run_engine<T: Send>(
    py: Python<'_>,
    read: impl FnOnce() -> Result<T, Problem> + Send,
) -> PyResult<Result<T, ProblemTuple>> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(read))) {
        Ok(result) => Ok(result.map_err(as_tuple)),
        Err(_) => Err(InternalError::new_err(
            "the store engine panicked; please report this with the store's layout",
        )),
    }
}

/// The TV bindings' answer: `(tvs, None)` or `(empty, problem)`.
fn tvs_or_problem(
    py: Python<'_>,
    result: Result<Vec<f64>, ProblemTuple>,
) -> (Bound<'_, PyArray1<f64>>, Option<ProblemTuple>) {
    match result {
        Ok(tv) => (tv.into_pyarray(py), None),
        Err(problem) => (Vec::<f64>::new().into_pyarray(py), Some(problem)),
    }
}

/// Row TVs of the blocks `blocks[i, axis] = (start, stop)` of arrays `p` and `q` in the local
/// store `root`, decoded with zarrs in parallel (checksums verified); with `row_tolerance`,
/// every row must first be a distribution summing to 1 within it. Returns `(tvs, problem)`
/// where `problem` is None or `(kind, key, message)` (nothing is raised for store damage: the
/// reader names it). With `top_delta`, each row gives two values: its TV, then the scoreboard's
/// `q(a) - p(a)` at `a = argmax p` (`decode_only`: zeros, nothing computed).
#[pyfunction]
#[pyo3(signature = (root, p, q, blocks, dtype, *, row_tolerance=None, decode_only=false,
                    top_delta=false))]
#[allow(clippy::too_many_arguments)]
pub fn store_blocks_tv<'py>(
    py: Python<'py>,
    root: &str,
    p: &str,
    q: &str,
    blocks: PyReadonlyArray3<'py, i64>,
    dtype: &str,
    row_tolerance: Option<f64>,
    decode_only: bool,
    top_delta: bool,
) -> PyResult<(Bound<'py, PyArray1<f64>>, Option<ProblemTuple>)> {
    let (kind, ranges) = parse_blocks(&blocks, dtype, row_tolerance)?;
    let output = BlockOutput::from_flags(decode_only, top_delta);
    let result = run_engine(py, || {
        let pv = LocalVariable::open(root, p)?;
        let qv = LocalVariable::open(root, q)?;
        blocks_tv(&pv, &qv, &ranges, kind, row_tolerance, output)
    })?;
    Ok(tvs_or_problem(py, result))
}

/// `store_blocks_tv` for a store on object storage: the caller fetched the chunk objects
/// (`p_chunks[i]`, `q_chunks[i]`: block `i`'s bytes, None where the object is absent; keys
/// `p_keys[i]`, `q_keys[i]`) and the arrays' metadata documents (`p_meta`, `q_meta`, as stored);
/// they are verified, decoded and consumed here in parallel with the GIL released. Each block
/// must be exactly one chunk of the layout kvcouple writes, else the problem is "unsupported".
#[pyfunction]
#[pyo3(signature = (p_meta, q_meta, blocks, p_keys, p_chunks, q_keys, q_chunks, dtype, *,
                    row_tolerance=None, decode_only=false, top_delta=false))]
pub fn store_chunks_tv<'py>(
    py: Python<'py>,
    p_meta: &str,
    q_meta: &str,
    blocks: PyReadonlyArray3<'py, i64>,
    p_keys: Vec<String>,
    p_chunks: Vec<Option<PyBackedBytes>>,
    q_keys: Vec<String>,
    q_chunks: Vec<Option<PyBackedBytes>>,
    dtype: &str,
    row_tolerance: Option<f64>,
    decode_only: bool,
    top_delta: bool,
) -> PyResult<(Bound<'py, PyArray1<f64>>, Option<ProblemTuple>)> {
    let (kind, ranges) = parse_blocks(&blocks, dtype, row_tolerance)?;
    let output = BlockOutput::from_flags(decode_only, top_delta);
    let n = ranges.len();
    if [p_keys.len(), p_chunks.len(), q_keys.len(), q_chunks.len()] != [n, n, n, n] {
        return Err(ShapeError::new_err(
            "one key and one chunk per block for each of p and q",
        ));
    }
    let result = run_engine(py, || {
        let pv = FetchedVariable::new("p", p_meta)?;
        let qv = FetchedVariable::new("q", q_meta)?;
        let objects = fetched(&p_keys, &p_chunks).chain(fetched(&q_keys, &q_chunks));
        let objects = FetchedObjects::new(objects);
        let (pk, qk): (Vec<&str>, Vec<&str>) = (
            p_keys.iter().map(String::as_str).collect(),
            q_keys.iter().map(String::as_str).collect(),
        );
        let (pv, qv) = (&pv, &qv);
        let tol = row_tolerance;
        chunks_tv((pv, qv), &ranges, (&pk, &qk), &objects, kind, tol, output)
    })?;
    Ok(tvs_or_problem(py, result))
}

/// Fetched objects as `(key, bytes)`, None where absent.
fn fetched<'a>(
    keys: &'a [String],
    chunks: &'a [Option<PyBackedBytes>],
) -> impl Iterator<Item = (&'a str, Option<&'a [u8]>)> {
    keys.iter()
        .map(String::as_str)
        .zip(chunks.iter().map(|c| c.as_deref()))
}

/// Whole chunks of small variables, decoded as stored: chunk `i` has key `keys[i]` and the
/// metadata document `metas[which[i]]`; its bytes are the file `root/keys[i]` of a local
/// store, or `chunks[i]` (fetched; None where absent). Where its array is sharded, `keys[i]`
/// is the shard's and `inner[i]` the inner chunk's linear (C-order) index within it (-1 for
/// an unsharded array; `inner` None: none is sharded); each shard is read once per call.
/// Returns `(decoded, problem)`: every chunk's little-endian bytes (uint8 arrays), or an empty list and
/// `(kind, key, message)` as for `store_blocks_tv` (inside a shard, the key is the shard's and
/// the inner chunk is named in the message, or after the key where it is absent). Read and
/// decoded in parallel with the GIL released. With `group`, every `group` consecutive
/// chunks' bytes come back joined as one (a variable's cell for a batch of documents: one
/// object, not one per document); with `runs`, run r joins the next `runs[r]` chunks (a
/// variable's every cell of a batch, document after document: its stack in one object).
#[pyfunction]
#[pyo3(signature = (metas, which, keys, *, root=None, chunks=None, inner=None, group=None, runs=None))]
#[allow(clippy::too_many_arguments)]
pub fn store_decode_chunks<'py>(
    py: Python<'py>,
    metas: Vec<String>,
    which: Vec<usize>,
    keys: Vec<String>,
    root: Option<String>,
    chunks: Option<Vec<Option<PyBackedBytes>>>,
    inner: Option<Vec<i64>>,
    group: Option<usize>,
    runs: Option<Vec<usize>>,
) -> PyResult<(Vec<Bound<'py, PyArray1<u8>>>, Option<ProblemTuple>)> {
    if which.len() != keys.len() || which.iter().any(|&w| w >= metas.len()) {
        return Err(ShapeError::new_err(
            "which must name a metadata document for every key",
        ));
    }
    let runs = match (group, runs) {
        (Some(_), Some(_)) => {
            return Err(InvalidInputError::new_err("give group or runs, not both"));
        }
        (None, Some(runs)) if runs.iter().sum::<usize>() != keys.len() => {
            return Err(ShapeError::new_err(format!(
                "runs must add up to the {} keys, got {} in all",
                keys.len(),
                runs.iter().sum::<usize>()
            )));
        }
        (None, Some(runs)) => runs,
        (group, None) => {
            let group = group.unwrap_or(1);
            if group == 0 || !keys.len().is_multiple_of(group) {
                return Err(ShapeError::new_err(format!(
                    "group must divide the {} keys into runs of at least one, got {group}",
                    keys.len()
                )));
            }
            vec![group; keys.len() / group]
        }
    };
    let inner: Vec<Option<u64>> = match inner {
        None => vec![None; keys.len()],
        Some(inner) if inner.len() != keys.len() => {
            return Err(ShapeError::new_err(format!(
                "inner must give one index per key ({} keys, {} indices)",
                keys.len(),
                inner.len()
            )))
        }
        Some(inner) => inner
            .into_iter()
            .map(|i| match i {
                -1 => Ok(None),
                i => u64::try_from(i).map(Some).map_err(|_| {
                    InvalidInputError::new_err(format!(
                        "inner chunk index {i}: give an index >= 0, or -1 for an unsharded array"
                    ))
                }),
            })
            .collect::<PyResult<_>>()?,
    };
    let files;
    let objects;
    let source: &dyn ChunkSource = match (&root, &chunks) {
        (Some(r), None) => {
            files = LocalFiles::new(r);
            &files
        }
        (None, Some(c)) if c.len() == keys.len() => {
            objects = FetchedObjects::new(fetched(&keys, c));
            &objects
        }
        _ => {
            return Err(InvalidInputError::new_err(
                "give root (a local store) or one fetched chunk per key, not both",
            ))
        }
    };
    let result = run_engine(py, || {
        let items: Vec<Chunk> = keys
            .iter()
            .zip(&which)
            .zip(&inner)
            .map(|((key, &w), &inner)| Chunk {
                key,
                meta: &metas[w],
                inner,
            })
            .collect();
        decode_runs(source, &items, &runs)
    })?;
    // Each run's bytes move into a numpy array (no copy under the GIL).
    Ok(match result {
        Ok(decoded) => (
            decoded.into_iter().map(|b| b.into_pyarray(py)).collect(),
            None,
        ),
        Err(problem) => (Vec::new(), Some(problem)),
    })
}

/// The crc32c (Castagnoli) checksum of `data`, as zarr's `crc32c` codec appends it to a chunk:
/// for the chunks read without the engine's decoders (string coordinates, `vlen-utf8`).
#[pyfunction]
pub fn store_crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// The strings of a `vlen-utf8` chunk (a string coordinate's): a little-endian u32 count, then
/// each string's u32 length and UTF-8 bytes. `ValueError` naming what is wrong where the bytes
/// are not that (cut short, bytes left over, not UTF-8).
#[pyfunction]
pub fn store_vlen_utf8(data: &[u8]) -> PyResult<Vec<String>> {
    vlen_utf8(data).map_err(pyo3::exceptions::PyValueError::new_err)
}

fn vlen_utf8(data: &[u8]) -> Result<Vec<String>, String> {
    let word = |at: usize| -> Result<usize, String> {
        data.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(|| "a length runs past the chunk's end".to_string())
    };
    let count = word(0).map_err(|_| "bytes left over, or no count".to_string())?;
    // At least four bytes per string: a count larger than that is damage, not an allocation.
    if count > data.len() / 4 {
        return Err(format!(
            "a count of {count} strings in {} bytes",
            data.len()
        ));
    }
    let mut out = Vec::with_capacity(count);
    let mut at = 4;
    for _ in 0..count {
        let size = word(at)?;
        at += 4;
        let bytes = data
            .get(at..at.saturating_add(size))
            .ok_or_else(|| "a string runs past the chunk's end".to_string())?;
        let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))?;
        out.push(text.to_string());
        at += size;
    }
    if at != data.len() {
        return Err("bytes left over, or no count".to_string());
    }
    Ok(out)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(store_crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(store_vlen_utf8, m)?)?;
    m.add_function(wrap_pyfunction!(store_decode_chunks, m)?)?;
    m.add_function(wrap_pyfunction!(store_blocks_tv, m)?)?;
    m.add_function(wrap_pyfunction!(store_chunks_tv, m)?)?;
    Ok(())
}
