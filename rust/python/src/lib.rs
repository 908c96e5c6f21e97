//! `kvcouple._core`: the private compiled module behind the `kvcouple` Python package.
//! Each submodule wraps one area of kvcouple-core; all error mapping lives in `errors`.

use pyo3::prelude::*;

mod arrays;
mod errors;
mod kernels;
mod object_fetcher;
mod stats;
mod store;
mod store_write;
mod synth;
mod tables;
mod units;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    kernels::register(m)?;
    synth::register(m)?;
    units::register(m)?;
    stats::register(m)?;
    tables::register(m)?;
    store::register(m)?;
    store_write::register(m)?;
    object_fetcher::register(m)?;
    Ok(())
}
