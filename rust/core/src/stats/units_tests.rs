//! Tests of `stats::units` (in their own file: the module is long enough without them).

use super::*;

fn shape(units: usize) -> UnitShape {
    UnitShape {
        units,
        replicates: 2,
        horizon: 3,
        branches: 1,
        lags: 4,
    }
}

#[test]
fn a_certain_divergence_at_the_first_step() {
    // h = 1 at step 1: O = 1, occupation T - 1, tau = 1, one mismatch per lag observed.
    let hazard = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0];
    let steps = [1, 1];
    let mismatch = [0i8, 1, 1, 1, 0, 1, 1, 1];
    let tv = [0.0, 0.5, 0.5, 0.5, 0.0, 0.5, 0.5, 0.5];
    let inputs = UnitInputs {
        hazard: &hazard,
        branch_step: &steps,
        branch_mismatch: &mismatch,
        branch_tv: &tv,
    };
    let out = estimate_units(&inputs, shape(1), 2, Estimator::Indicator, true).unwrap();
    assert_eq!(out.values[0], 1.0); // occurrence
    assert_eq!(out.values[1], 2.0); // occupation
    assert_eq!(out.values[4], 2.0); // window part: lags 1..2
    assert_eq!(out.values[5], 1.0); // tail part: lag 3
    assert_eq!(out.values[3], 4.0); // expected mismatches
    assert_eq!(out.stderr[0], 0.0);
    assert_eq!(out.median_tau[0], 1.0);
    assert_eq!(&out.survival[..4], &[1.0, 0.0, 0.0, 0.0]);
    let tv_out = estimate_units(&inputs, shape(1), 2, Estimator::Tv, true).unwrap();
    assert_eq!(tv_out.values[4], 1.0);
    assert_eq!(tv_out.tv_lag_num[1], 0.5);
    assert_eq!(tv_out.tv_lag_den[1], 1.0);
}

#[test]
fn median_spreads_each_step_over_its_class() {
    assert_eq!(median(&[0.0, 1.0, 0.0]), 2.0); // one step: that step
    assert_eq!(median(&[0.5, 0.5]), 1.5); // 1/2 at (1/2, 3/2], 1/2 at (3/2, 5/2]
    assert_eq!(median(&[0.2, 0.2, 0.2]), 2.0); // the middle of three equal steps
    assert!((median(&[0.1, 0.3, 0.0]) - (1.5 + 1.0 / 3.0)).abs() < 1e-15);
    assert!(median(&[0.0, 0.0]).is_nan()); // nothing diverges
    assert!(median(&[]).is_nan());
}

#[test]
fn damage_is_named_not_estimated() {
    let mut hazard = [0.5; 6];
    hazard[4] = 1.5;
    let inputs = UnitInputs {
        hazard: &hazard,
        branch_step: &[1, 1],
        branch_mismatch: &[0; 8],
        branch_tv: &[0.0; 8],
    };
    let out = estimate_units(&inputs, shape(1), 2, Estimator::Indicator, true).unwrap();
    assert_eq!(
        out.damage[0],
        Some(UnitDamage::Hazard {
            replicate: 1,
            step: 1,
            value: 1.5
        })
    );
    let hazard = [0.5; 6];
    let inputs = UnitInputs {
        branch_step: &[1, 0],
        hazard: &hazard,
        ..inputs
    };
    let out = estimate_units(&inputs, shape(1), 2, Estimator::Indicator, true).unwrap();
    assert!(matches!(
        out.damage[0],
        Some(UnitDamage::MissingBranch { replicate: 1, .. })
    ));
    let inputs = UnitInputs {
        branch_step: &[1, 9],
        ..inputs
    };
    let out = estimate_units(&inputs, shape(1), 2, Estimator::Indicator, true).unwrap();
    assert_eq!(
        out.damage[0],
        Some(UnitDamage::BranchPastHorizon {
            replicate: 1,
            branch: 0,
            step: 9
        })
    );
}

#[test]
fn shapes_and_windows_are_checked() {
    let inputs = UnitInputs {
        hazard: &[0.5; 5],
        branch_step: &[1, 1],
        branch_mismatch: &[0; 8],
        branch_tv: &[0.0; 8],
    };
    assert!(estimate_units(&inputs, shape(1), 2, Estimator::Tv, true).is_err());
    let inputs = UnitInputs {
        hazard: &[0.5; 6],
        ..inputs
    };
    assert!(estimate_units(&inputs, shape(1), 4, Estimator::Tv, true).is_err());
}
