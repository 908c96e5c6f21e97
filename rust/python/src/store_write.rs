//! Writing sharded trace stores: a shard encoded whole (`kvcouple-store`'s `shard_write`).

use std::panic::{catch_unwind, AssertUnwindSafe};

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use kvcouple_store::shard_write::{encode_shard, ShardValues};

use crate::errors::{InternalError, ShapeError};

/// One Zarr v3 shard (`sharding_indexed`, index at the end, bytes -> zstd -> crc32c inner
/// chunks, crc32c on the index) of a variable: `data` its values as bytes (C order, little
/// endian, the whole shard shape), `present` the rows along the first axis inside the array
/// (the others are not stored). Encoded in parallel with the GIL released.
#[pyfunction]
#[pyo3(signature = (data, itemsize, shard, inner, present, *, level=1))]
pub fn store_encode_shard<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    itemsize: usize,
    shard: Vec<usize>,
    inner: Vec<usize>,
    present: usize,
    level: i32,
) -> PyResult<Bound<'py, PyBytes>> {
    let bytes = data
        .as_slice()
        .map_err(|_| ShapeError::new_err("data must be a contiguous uint8 array"))?;
    let values = ShardValues {
        data: bytes,
        itemsize,
        shard: &shard,
        inner: &inner,
        present,
        level,
    };
    let encoded = py.detach(|| catch_unwind(AssertUnwindSafe(|| encode_shard(&values))));
    match encoded {
        Ok(Ok(shard)) => Ok(PyBytes::new(py, &shard)),
        Ok(Err(problem)) => Err(ShapeError::new_err(problem.to_string())),
        Err(_) => Err(InternalError::new_err(
            "the shard encoder panicked; please report this with the store's layout",
        )),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(store_encode_shard, m)?)?;
    Ok(())
}
