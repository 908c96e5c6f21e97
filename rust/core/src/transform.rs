//! The decoding transform (temperature, top-k, top-p) that turns logits into the kernel.
//!
//! The same rule is implemented in torch (`kvcouple.torch_coupling`) so that a traced
//! distribution and one recomputed here from stored logits agree:
//! 1. `z = logits / temperature`;
//! 2. top-k keeps every entry `>=` the k-th largest value (ties at the cut are kept);
//! 3. top-p sorts the survivors by probability, descending (stable: ties by index), and keeps
//!    each entry whose preceding mass is `< top_p` (so at least one entry survives);
//! 4. softmax over the survivors, in f64.

use crate::error::{KvError, KvResult};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transform {
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
}

impl Default for Transform {
    fn default() -> Self {
        Transform {
            temperature: 1.0,
            top_k: None,
            top_p: None,
        }
    }
}

impl Transform {
    pub fn validate(&self) -> KvResult<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(KvError::InvalidArgument(format!(
                "temperature must be a finite number > 0, got {} (use top_k=1 for greedy decoding)",
                self.temperature
            )));
        }
        if !(1.0 / self.temperature).is_finite() {
            return Err(KvError::InvalidArgument(format!(
                "temperature = {:e} is too small: 1 / temperature overflows float64 \
                 (use top_k=1 for greedy decoding)",
                self.temperature
            )));
        }
        if self.top_k == Some(0) {
            return Err(KvError::InvalidArgument("top_k must be >= 1".into()));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(KvError::InvalidArgument(format!(
                    "top_p must be in (0, 1], got {p}"
                )));
            }
        }
        Ok(())
    }

    /// Apply the transform to one row of logits (already widened to f64), in place: the row
    /// becomes a probability vector. `scratch` is reused between calls to avoid allocation.
    /// Returns false when the row holds a NaN or +inf logit (-inf means "masked" and is fine).
    pub fn apply(&self, row: &mut [f64], scratch: &mut Vec<usize>) -> bool {
        let inv_t = 1.0 / self.temperature;
        let mut max = f64::NEG_INFINITY;
        for &z in row.iter() {
            if z.is_nan() || z == f64::INFINITY {
                return false;
            }
            max = max.max(z);
        }
        // At small temperatures z / t can overflow; softmax is shift-invariant, so then scale
        // z - max (<= 0) instead, which cannot reach +inf.
        let shift = if max.is_finite() && !(max * inv_t).is_finite() {
            max
        } else {
            0.0
        };
        for z in row.iter_mut() {
            *z = (*z - shift) * inv_t;
        }
        let v = row.len();
        if let Some(k) = self.top_k {
            if k < v {
                let mut sorted: Vec<f64> = row.to_vec();
                let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
                let cut = *kth;
                for z in row.iter_mut() {
                    if *z < cut {
                        *z = f64::NEG_INFINITY;
                    }
                }
            }
        }
        softmax_in_place(row);
        if let Some(top_p) = self.top_p {
            if top_p < 1.0 {
                scratch.clear();
                scratch.extend((0..v).filter(|&i| row[i] > 0.0));
                // Stable descending order: ties keep index order, as torch.sort(stable=True).
                scratch.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                let mut before = 0.0;
                let mut keep_until = scratch.len();
                for (rank, &i) in scratch.iter().enumerate() {
                    if before >= top_p {
                        keep_until = rank;
                        break;
                    }
                    before += row[i];
                }
                for &i in &scratch[keep_until..] {
                    row[i] = 0.0;
                }
                let total: f64 = row.iter().sum();
                for x in row.iter_mut() {
                    *x /= total;
                }
            }
        }
        true
    }
}

fn softmax_in_place(row: &mut [f64]) {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        // Every logit masked: no distribution; callers treat an all-zero row as invalid.
        row.iter_mut().for_each(|x| *x = 0.0);
        return;
    }
    let mut total = 0.0;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        total += *x;
    }
    for x in row.iter_mut() {
        *x /= total;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_temperatures_do_not_overflow() {
        let t = Transform {
            temperature: 1e-300,
            ..Transform::default()
        };
        assert!(t.validate().is_ok());
        assert_eq!(apply(t, &[1.0, 3.0, 2.0]), vec![0.0, 1.0, 0.0]);
        let huge = [-1e300, -2e300];
        assert_eq!(apply(t, &huge), vec![1.0, 0.0]);
        let t = Transform {
            temperature: 1e-320,
            ..Transform::default()
        };
        assert!(t.validate().is_err());
    }

    fn apply(t: Transform, logits: &[f64]) -> Vec<f64> {
        let mut row = logits.to_vec();
        assert!(t.apply(&mut row, &mut Vec::new()));
        row
    }

    #[test]
    fn softmax_plain() {
        let p = apply(Transform::default(), &[0.0, 0.0, (2.0f64).ln()]);
        assert!((p[0] - 0.25).abs() < 1e-15 && (p[2] - 0.5).abs() < 1e-15);
    }

    #[test]
    fn top_k_keeps_ties() {
        let t = Transform {
            top_k: Some(2),
            ..Default::default()
        };
        let p = apply(t, &[1.0, 3.0, 2.0, 2.0]);
        assert_eq!(p[0], 0.0);
        assert!(p[1] > 0.0 && p[2] > 0.0 && p[3] > 0.0);
    }

    #[test]
    fn top_p_keeps_smallest_prefix() {
        // probabilities 0.5, 0.3, 0.2: top_p = 0.6 keeps the first two (mass before 2nd is 0.5 < 0.6).
        let l = [0.5f64.ln(), 0.3f64.ln(), 0.2f64.ln()];
        let t = Transform {
            top_p: Some(0.6),
            ..Default::default()
        };
        let p = apply(t, &l);
        assert!((p[0] - 0.625).abs() < 1e-12 && (p[1] - 0.375).abs() < 1e-12 && p[2] == 0.0);
        let t = Transform {
            top_p: Some(0.5),
            ..Default::default()
        };
        let p = apply(t, &l);
        assert_eq!(p, vec![1.0, 0.0, 0.0]);
    }

    #[test]
    fn rejects_bad_parameters() {
        for t in [
            Transform {
                temperature: 0.0,
                ..Default::default()
            },
            Transform {
                top_k: Some(0),
                ..Default::default()
            },
            Transform {
                top_p: Some(1.5),
                ..Default::default()
            },
        ] {
            assert!(t.validate().is_err());
        }
    }
}
