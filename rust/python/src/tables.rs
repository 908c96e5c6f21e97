//! Wrapper of `kvcouple-core::text_table`: a table's rows as CSV or JSON text.

use kvcouple_core::text_table::{ColumnSource, TextFormat, TextTable};
use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{guard, ShapeError};

/// Rows `start..stop` of a table given column-wise, as `format` text ("csv": as
/// `csv.writer` writes them; "json": as `json.dumps` writes a list of dicts, between its
/// brackets). `columns`: (name, kind, j) in order, kind "number", "flag" or "label" reading
/// column j of `numbers` (rows x width, float64), `flags` (rows x width, bool) or `codes`
/// (rows x width, uint32: indices into `labels[j]`).
#[pyfunction]
#[pyo3(signature = (columns, numbers, flags, codes, labels, format, start, stop))]
#[allow(clippy::too_many_arguments)]
pub fn format_table_rows<'py>(
    py: Python<'py>,
    columns: Vec<(String, String, usize)>,
    numbers: PyReadonlyArray2<'py, f64>,
    flags: PyReadonlyArray2<'py, bool>,
    codes: PyReadonlyArray2<'py, u32>,
    labels: Vec<Vec<String>>,
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
    let rows = numbers.shape()[0];
    let slice = |what: &str| ShapeError::new_err(format!("{what} must be C-contiguous"));
    let table = TextTable {
        names: &names,
        sources: &sources,
        rows,
        numbers: numbers.as_slice().map_err(|_| slice("numbers"))?,
        number_width: numbers.shape()[1],
        flags: flags.as_slice().map_err(|_| slice("flags"))?,
        flag_width: flags.shape()[1],
        codes: codes.as_slice().map_err(|_| slice("codes"))?,
        code_width: codes.shape()[1],
        labels: &labels,
    };
    let text = py.detach(|| guard(|| table.format(format, start, stop)))?;
    Ok(PyBytes::new(py, &text))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(format_table_rows, m)?)?;
    Ok(())
}
