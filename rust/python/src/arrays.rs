//! Borrowing numpy matrices as core `Rows` without copying.

use kvcouple_core::rows::Rows;
use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::{InvalidInputError, ShapeError};

/// A readonly borrow of a 2-D numpy array in one of the supported element formats.
pub enum Matrix<'py> {
    U16(PyReadonlyArray2<'py, u16>, bool), // bool: bfloat16 (else IEEE float16)
    F32(PyReadonlyArray2<'py, f32>),
    F64(PyReadonlyArray2<'py, f64>),
}

impl<'py> Matrix<'py> {
    /// `dtype` is the logical format: "float16" and "bfloat16" arrive as uint16 views.
    pub fn extract(obj: &Bound<'py, PyAny>, dtype: &str, name: &str) -> PyResult<Self> {
        let wrong = |e: PyErr| {
            InvalidInputError::new_err(format!("{name} must be a 2-D numpy array of {dtype}: {e}"))
        };
        Ok(match dtype {
            "float16" | "bfloat16" => {
                Matrix::U16(obj.extract().map_err(wrong)?, dtype == "bfloat16")
            }
            "float32" => Matrix::F32(obj.extract().map_err(wrong)?),
            "float64" => Matrix::F64(obj.extract().map_err(wrong)?),
            other => {
                return Err(InvalidInputError::new_err(format!(
                "unsupported dtype {other:?} for {name}: use float16, bfloat16, float32 or float64"
            )))
            }
        })
    }

    pub fn shape(&self) -> (usize, usize) {
        let s = match self {
            Matrix::U16(a, _) => a.shape(),
            Matrix::F32(a) => a.shape(),
            Matrix::F64(a) => a.shape(),
        };
        (s[0], s[1])
    }

    /// The contiguous memory as core rows (C order required; the Python layer makes it so).
    pub fn rows(&self, name: &str) -> PyResult<Rows<'_>> {
        let not_contig = |_| {
            ShapeError::new_err(format!(
                "{name} must be C-contiguous (use np.ascontiguousarray)"
            ))
        };
        Ok(match self {
            Matrix::U16(a, false) => Rows::F16(a.as_slice().map_err(not_contig)?),
            Matrix::U16(a, true) => Rows::BF16(a.as_slice().map_err(not_contig)?),
            Matrix::F32(a) => Rows::F32(a.as_slice().map_err(not_contig)?),
            Matrix::F64(a) => Rows::F64(a.as_slice().map_err(not_contig)?),
        })
    }
}

/// The two matrices `p` and `q` of one call, borrowed in one logical dtype, same shape.
pub struct MatrixPair<'py> {
    p: Matrix<'py>,
    q: Matrix<'py>,
    /// `(rows, vocab)`.
    pub shape: (usize, usize),
}

impl<'py> MatrixPair<'py> {
    pub fn extract(p: &Bound<'py, PyAny>, q: &Bound<'py, PyAny>, dtype: &str) -> PyResult<Self> {
        let p = Matrix::extract(p, dtype, "p")?;
        let q = Matrix::extract(q, dtype, "q")?;
        let (sp, sq) = (p.shape(), q.shape());
        if sp != sq {
            return Err(ShapeError::new_err(format!(
                "p has shape {sp:?} but q has shape {sq:?}"
            )));
        }
        Ok(MatrixPair { p, q, shape: sp })
    }

    /// Both as core rows, ready to move into a GIL-free section.
    pub fn views(&self) -> PyResult<(Rows<'_>, Rows<'_>)> {
        Ok((self.p.rows("p")?, self.q.rows("q")?))
    }
}
