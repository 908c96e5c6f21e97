//! Object storage for the store engine (`kvcouple-fetch`): a store's objects fetched with
//! many requests in flight, the GIL released, and handed back as bytes.

use kvcouple_fetch::{Fetcher, DEFAULT_CONCURRENCY};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{fetch_to_py, interruptible};

/// A trace store's root on S3 (or an S3-compatible server) and the client that reads it.
#[pyclass(module = "kvcouple._core", frozen)]
pub struct ObjectFetcher {
    inner: Fetcher,
    url: String,
}

#[pymethods]
impl ObjectFetcher {
    /// `url` is `s3://bucket/path`; `config` holds object_store's S3 settings by name
    /// (`aws_access_key_id`, `aws_endpoint_url`, ...): nothing is read from the environment.
    #[new]
    #[pyo3(signature = (url, config, *, concurrency = DEFAULT_CONCURRENCY))]
    fn new(url: String, config: Vec<(String, String)>, concurrency: usize) -> PyResult<Self> {
        let inner = Fetcher::s3(&url, &config).map_err(fetch_to_py)?;
        Ok(Self {
            inner: inner.with_concurrency(concurrency),
            url,
        })
    }

    /// The objects `keys` (relative to the store's root), in order; None where one does not
    /// exist. Ctrl-C stops new requests and raises KeyboardInterrupt.
    fn fetch<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
    ) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let got = interruptible(py, |cancel| Ok(self.inner.fetch(&keys, cancel)))?
            .map_err(fetch_to_py)?;
        Ok(got
            .into_iter()
            .map(|b| b.map(|b| PyBytes::new(py, &b)))
            .collect())
    }

    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    fn __repr__(&self) -> String {
        format!("ObjectFetcher({:?})", self.url)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ObjectFetcher>()?;
    Ok(())
}
