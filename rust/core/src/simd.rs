//! The one place that decides which compiled variant of a kernel runs on this CPU.
//!
//! Every kernel with vector variants (the divergence block kernel, the float16 widening and
//! row kernels of [`crate::half`]) matches on [`level`]. All variants of a kernel add the same
//! terms in the same order, so results are bit-identical whatever the level.

use std::sync::OnceLock;

/// What the CPU runs, from least to most.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Plain Rust compiled for the target's baseline (x86-64 SSE2, aarch64 NEON).
    Portable,
    /// x86-64 with AVX2, FMA and F16C (every AVX2 CPU since Haswell has all three; one level
    /// for the three keeps one ladder).
    Avx2,
    /// [`Level::Avx2`] plus AVX-512F and AVX-512DQ.
    Avx512,
}

/// This CPU's level, detected once. `KVCOUPLE_NO_AVX512=1` (read at the first call) caps it
/// at [`Level::Avx2`]: for comparing, or where AVX-512 lowers the clock of neighbouring work.
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(detect)
}

fn detect() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") && has!("f16c") {
            if has!("avx512f")
                && has!("avx512dq")
                && std::env::var_os("KVCOUPLE_NO_AVX512").is_none()
            {
                return Level::Avx512;
            }
            return Level::Avx2;
        }
    }
    Level::Portable
}
