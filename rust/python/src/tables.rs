//! Wrapper of `kvcouple-core::text_table`: a table's rows as CSV or JSON text.

use kvcouple_core::parallel;
use kvcouple_core::text_table::{ColumnSource, TextFormat, TextTable};
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

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
        let (numbers, flags, codes) = self.read_only(py)?;
        let table = self.table(&numbers, &flags, &codes)?;
        let text = py.detach(|| guard(|| table.format(format, start, stop)))?;
        Ok(PyBytes::new(py, &text))
    }

    /// Every row appended to the file `csv` as CSV and to the file `json` as JSON rows (the
    /// bytes `text` gives for each), a block of `block_rows` rows at a time, each number
    /// formatted once for both, on at most `threads` threads (`0`: the pool's all); the GIL is
    /// released until the last is written. A file that cannot be written raises `OSError`
    /// naming it.
    #[pyo3(signature = (csv, json, block_rows=4096, threads=0))]
    fn append_to(
        &self,
        py: Python<'_>,
        csv: PathBuf,
        json: PathBuf,
        block_rows: usize,
        threads: usize,
    ) -> PyResult<()> {
        let (numbers, flags, codes) = self.read_only(py)?;
        let table = self.table(&numbers, &flags, &codes)?;
        let open = |path: &PathBuf| {
            OpenOptions::new()
                .append(true)
                .open(path)
                .map_err(|e| io_error(path, e))
        };
        let (mut csv_file, mut json_file) = (open(&csv)?, open(&json)?);
        let block = block_rows.max(1);
        let write = || -> PyResult<()> {
            for start in (0..table.rows).step_by(block) {
                let stop = (start + block).min(table.rows);
                let (csv_text, json_text) = guard(|| table.format_both(start, stop))?;
                csv_file
                    .write_all(&csv_text)
                    .map_err(|e| io_error(&csv, e))?;
                // JSON blocks are joined by ", " (the rows of one list).
                if start > 0 {
                    json_file.write_all(b", ").map_err(|e| io_error(&json, e))?;
                }
                json_file
                    .write_all(&json_text)
                    .map_err(|e| io_error(&json, e))?;
            }
            Ok(())
        };
        py.detach(|| guard(|| parallel::install_at_most(threads, write)))?
    }

    /// Rows in the table.
    #[getter]
    fn rows(&self, py: Python<'_>) -> usize {
        self.numbers.bind(py).shape()[0]
    }
}

#[allow(clippy::type_complexity)]
impl TextColumns {
    /// The columns borrowed read-only for a call (try_readonly: a borrow conflict is an
    /// error, not a panic across the boundary).
    fn read_only<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(
        PyReadonlyArray2<'py, f64>,
        PyReadonlyArray2<'py, bool>,
        PyReadonlyArray2<'py, u32>,
    )> {
        let busy = |e: numpy::BorrowError| {
            pyo3::exceptions::PyRuntimeError::new_err(format!("the columns cannot be read: {e}"))
        };
        Ok((
            self.numbers.bind(py).try_readonly().map_err(busy)?,
            self.flags.bind(py).try_readonly().map_err(busy)?,
            self.codes.bind(py).try_readonly().map_err(busy)?,
        ))
    }

    /// The core's view of the columns.
    fn table<'a>(
        &'a self,
        numbers: &'a PyReadonlyArray2<'_, f64>,
        flags: &'a PyReadonlyArray2<'_, bool>,
        codes: &'a PyReadonlyArray2<'_, u32>,
    ) -> PyResult<TextTable<'a>> {
        let slice = |what: &str| ShapeError::new_err(format!("{what} must be C-contiguous"));
        Ok(TextTable {
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
        })
    }
}

fn io_error(path: &Path, e: std::io::Error) -> PyErr {
    PyOSError::new_err(format!("{}: {e}", path.display()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TextColumns>()?;
    Ok(())
}
