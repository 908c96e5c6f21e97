//! Wrapper of `kvcouple-core::text_table`: a table's rows as CSV or JSON text.

use kvcouple_core::text_table::{ColumnSource, TextFormat, TextTable};
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{guard, ShapeError};

/// A table given column-wise, taken once and then written a block of rows at a time:
/// `columns` (name, kind, j) in order, kind "number", "flag" or "label" reading column j of
/// `numbers` (rows x width, float64), `flags` (rows x width, bool) or `codes` (rows x width,
/// uint32: indices into `labels[j]`). The labels are converted once here, not for every
/// block (100k documents' ids, 26 times over for the two formats).
#[pyclass(module = "kvcouple._core", frozen)]
pub struct TextColumns {
    names: Vec<String>,
    sources: Vec<ColumnSource>,
    numbers: Py<PyArray2<f64>>,
    flags: Py<PyArray2<bool>>,
    codes: Py<PyArray2<u32>>,
    labels: Vec<Vec<String>>,
}

#[pymethods]
impl TextColumns {
    #[new]
    fn new(
        columns: Vec<(String, String, usize)>,
        numbers: Bound<'_, PyArray2<f64>>,
        flags: Bound<'_, PyArray2<bool>>,
        codes: Bound<'_, PyArray2<u32>>,
        labels: Vec<Vec<String>>,
    ) -> PyResult<Self> {
        let mut names = Vec::with_capacity(columns.len());
        let mut sources = Vec::with_capacity(columns.len());
        for (name, kind, j) in columns {
            sources.push(match kind.as_str() {
                "number" => ColumnSource::Number(j),
                "flag" => ColumnSource::Flag(j),
                "label" => ColumnSource::Label(j),
                other => {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "column {name:?}: kind must be 'number', 'flag' or 'label', got {other:?}"
                    )))
                }
            });
            names.push(name);
        }
        let contiguous = |what: &str, ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(ShapeError::new_err(format!("{what} must be C-contiguous")))
            }
        };
        contiguous("numbers", numbers.is_c_contiguous())?;
        contiguous("flags", flags.is_c_contiguous())?;
        contiguous("codes", codes.is_c_contiguous())?;
        Ok(Self {
            names,
            sources,
            numbers: numbers.unbind(),
            flags: flags.unbind(),
            codes: codes.unbind(),
            labels,
        })
    }

    /// Rows `start..stop` as `format` text ("csv": as `csv.writer` writes them; "json": as
    /// `json.dumps` writes a list of dicts, between its brackets). The GIL is released while
    /// they are formatted (all cores).
    fn text<'py>(
        &self,
        py: Python<'py>,
        format: &str,
        start: usize,
        stop: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let format = match format {
            "csv" => TextFormat::Csv,
            "json" => TextFormat::JsonRows,
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "format must be 'csv' or 'json', got {other:?}"
                )))
            }
        };
        // try_readonly: a borrow conflict is an error, not a panic across the boundary.
        let busy = |e: numpy::BorrowError| {
            pyo3::exceptions::PyRuntimeError::new_err(format!("the columns cannot be read: {e}"))
        };
        let numbers: PyReadonlyArray2<'py, f64> =
            self.numbers.bind(py).try_readonly().map_err(busy)?;
        let flags: PyReadonlyArray2<'py, bool> =
            self.flags.bind(py).try_readonly().map_err(busy)?;
        let codes: PyReadonlyArray2<'py, u32> = self.codes.bind(py).try_readonly().map_err(busy)?;
        let slice = |what: &str| ShapeError::new_err(format!("{what} must be C-contiguous"));
        let table = TextTable {
            names: &self.names,
            sources: &self.sources,
            rows: numbers.shape()[0],
            numbers: numbers.as_slice().map_err(|_| slice("numbers"))?,
            number_width: numbers.shape()[1],
            flags: flags.as_slice().map_err(|_| slice("flags"))?,
            flag_width: flags.shape()[1],
            codes: codes.as_slice().map_err(|_| slice("codes"))?,
            code_width: codes.shape()[1],
            labels: &self.labels,
        };
        let text = py.detach(|| guard(|| table.format(format, start, stop)))?;
        Ok(PyBytes::new(py, &text))
    }

    /// Rows in the table.
    #[getter]
    fn rows(&self, py: Python<'_>) -> usize {
        self.numbers.bind(py).shape()[0]
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TextColumns>()?;
    Ok(())
}
