//! Cooperative cancellation of long computations (Ctrl-C in Python).
//!
//! A long solver takes a `&Cancel` and calls [`Cancel::check`] often enough (every few
//! milliseconds of work); whoever owns the flag (the Python binding, watching for signals)
//! calls [`Cancel::cancel`], and the solver returns [`KvError::Interrupted`] promptly.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{KvError, KvResult};

#[derive(Debug, Default)]
pub struct Cancel(AtomicBool);

impl Cancel {
    pub const fn new() -> Self {
        Cancel(AtomicBool::new(false))
    }

    /// Ask the computation to stop.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// `Err(Interrupted)` once [`Cancel::cancel`] was called.
    pub fn check(&self) -> KvResult<()> {
        if self.is_cancelled() {
            Err(KvError::Interrupted)
        } else {
            Ok(())
        }
    }
}

/// A flag nobody cancels, for callers that do not need cancellation.
pub static NEVER: Cancel = Cancel::new();
