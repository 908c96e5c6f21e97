//! The thread pool every parallel kernel runs in.
//!
//! By default rayon's global pool (all cores, or `RAYON_NUM_THREADS`). `set_num_threads`
//! installs a dedicated pool, e.g. one thread per Dask worker process so that workers do not
//! oversubscribe the machine; `KVCOUPLE_NUM_THREADS` does the same from the environment.

use std::sync::{Arc, OnceLock, RwLock};

use rayon::{ThreadPool, ThreadPoolBuilder};

use crate::error::{KvError, KvResult};

fn slot() -> &'static RwLock<Option<Arc<ThreadPool>>> {
    static POOL: OnceLock<RwLock<Option<Arc<ThreadPool>>>> = OnceLock::new();
    POOL.get_or_init(|| {
        let from_env = std::env::var("KVCOUPLE_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .and_then(|n| ThreadPoolBuilder::new().num_threads(n).build().ok())
            .map(Arc::new);
        RwLock::new(from_env)
    })
}

/// Use `n` threads for every later kernel call (`0` restores the default pool).
pub fn set_num_threads(n: usize) -> KvResult<()> {
    let pool = if n == 0 {
        None
    } else {
        Some(Arc::new(
            ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .map_err(|e| KvError::InvalidArgument(format!("cannot start {n} threads: {e}")))?,
        ))
    };
    *slot().write().unwrap_or_else(|e| e.into_inner()) = pool;
    Ok(())
}

/// The number of threads kernels will use.
pub fn num_threads() -> usize {
    match slot().read().unwrap_or_else(|e| e.into_inner()).as_ref() {
        Some(p) => p.current_num_threads(),
        None => rayon::current_num_threads(),
    }
}

/// Run `f` on at most `threads` threads of the configured pool's count (`0`: all of them):
/// work that runs beside other work holding the rest of the cores.
pub fn install_at_most<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> KvResult<R> {
    if threads == 0 || threads >= num_threads() {
        return Ok(install(f));
    }
    let pool = ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| KvError::InvalidArgument(format!("cannot start {threads} threads: {e}")))?;
    Ok(pool.install(f))
}

/// Run `f` inside the configured pool.
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let pool = slot().read().unwrap_or_else(|e| e.into_inner()).clone();
    match pool {
        Some(p) => p.install(f),
        None => f(),
    }
}
