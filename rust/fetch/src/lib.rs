//! A trace store's objects fetched from object storage (S3 and S3-compatible servers) for the
//! store engine, with many requests in flight on one tokio runtime per process.
//!
//! The caller names the objects (chunk keys relative to the store's root) and gets their bytes
//! back in the same order, `None` for an object that does not exist; decoding and checking
//! stay in `kvcouple-store` (`fetched::chunks_tv`, `chunks::decode_chunks`), which take these
//! bytes as they are.

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, RetryConfig};
use tokio::runtime::Runtime;

use kvcouple_core::cancel::Cancel;

/// Requests in flight at once by default: enough to hide round trips to a remote server,
/// few enough that one reader does not flood it.
pub const DEFAULT_CONCURRENCY: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The address or a setting cannot be used (nothing was fetched).
    #[error("{0}")]
    Config(String),
    /// A request failed for a reason other than the object's absence (after retries).
    #[error("cannot fetch {key}: {message}")]
    Request { key: String, message: String },
    /// Cancelled (Ctrl-C) before every object was fetched.
    #[error("interrupted")]
    Interrupted,
}

/// A store's root on object storage and the client that reads it.
pub struct Fetcher {
    store: Arc<dyn ObjectStore>,
    root: Path,
    concurrency: usize,
}

impl Fetcher {
    /// `s3://bucket/path/to/store.zarr` with `config`: object_store's S3 settings by name
    /// (`aws_access_key_id`, `aws_endpoint_url`, `aws_region`, `aws_allow_http`, ...). Nothing
    /// is read from the environment: the caller decides which settings apply.
    pub fn s3(url: &str, config: &[(String, String)]) -> Result<Self, FetchError> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| FetchError::Config(format!("{url:?} is not an s3:// address")))?;
        let (bucket, root) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(FetchError::Config(format!("{url:?} names no bucket")));
        }
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            // A server that is down is reported in seconds, not after object_store's default
            // three minutes of retries.
            .with_retry(RetryConfig {
                max_retries: 3,
                retry_timeout: Duration::from_secs(30),
                ..RetryConfig::default()
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(60)),
            );
        for (key, value) in config {
            let k = AmazonS3ConfigKey::from_str(key)
                .map_err(|_| FetchError::Config(format!("unknown S3 setting {key:?}")))?;
            builder = builder.with_config(k, value);
        }
        install_crypto();
        let store = builder
            .build()
            .map_err(|e| FetchError::Config(format!("cannot use {url}: {e}")))?;
        Ok(Self::new(Arc::new(store), root))
    }

    /// A fetcher over any object store (tests use object_store's in-memory one).
    pub fn new(store: Arc<dyn ObjectStore>, root: &str) -> Self {
        Self {
            store,
            root: Path::from(root.trim_matches('/')),
            concurrency: DEFAULT_CONCURRENCY,
        }
    }

    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    fn location(&self, key: &str) -> Path {
        let mut parts: Vec<String> = self.root.parts().map(|p| p.as_ref().to_owned()).collect();
        parts.extend(key.split('/').filter(|s| !s.is_empty()).map(str::to_owned));
        Path::from_iter(parts)
    }

    /// The objects `keys` (relative to the root), in order; `None` where one does not exist.
    /// At most `concurrency` requests are in flight; `cancel` stops new ones from starting.
    pub fn fetch(
        &self,
        keys: &[String],
        cancel: &Cancel,
    ) -> Result<Vec<Option<Bytes>>, FetchError> {
        let runtime = runtime()?;
        let requests = keys.iter().map(|key| {
            let location = self.location(key);
            let store = Arc::clone(&self.store);
            async move {
                if cancel.is_cancelled() {
                    return Err(FetchError::Interrupted);
                }
                let failed = |e: object_store::Error| FetchError::Request {
                    key: key.clone(),
                    message: e.to_string(),
                };
                match store.get(&location).await {
                    Ok(got) => got.bytes().await.map(Some).map_err(failed),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(failed(e)),
                }
            }
        });
        runtime.block_on(
            stream::iter(requests)
                .buffered(self.concurrency)
                .try_collect(),
        )
    }
}

/// rustls is built without a default crypto provider (so that aws-lc-rs stays out): install
/// ring's once per process. A provider someone else installed first is kept.
fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The process's runtime, made again in a forked child (a runtime's threads do not survive
/// `fork`, and Dask or multiprocessing workers may fork a process that already fetched).
fn runtime() -> Result<Arc<Runtime>, FetchError> {
    static RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut held = RUNTIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((owner, rt)) = held.as_ref() {
        if *owner == pid {
            return Ok(Arc::clone(rt));
        }
        // Inherited from the parent: its worker threads are gone; never drop it here.
        std::mem::forget(held.take());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvcouple-fetch")
        .enable_all()
        .build()
        .map(Arc::new)
        .map_err(|e| FetchError::Config(format!("cannot start the fetch runtime: {e}")))?;
    *held = Some((pid, Arc::clone(&rt)));
    Ok(rt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::PutPayload;

    fn store_with(objects: &[(&str, &[u8])]) -> Arc<dyn ObjectStore> {
        let store = Arc::new(InMemory::new());
        let rt = runtime().unwrap();
        for (key, bytes) in objects {
            rt.block_on(store.put(&Path::from(*key), PutPayload::from(bytes.to_vec())))
                .unwrap();
        }
        store
    }

    fn keys(k: &[&str]) -> Vec<String> {
        k.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn objects_come_back_in_order_and_absent_ones_as_none() {
        let store = store_with(&[("run.zarr/p/c/0/0", b"zero"), ("run.zarr/p/c/0/1", b"one")]);
        let f = Fetcher::new(store, "/run.zarr/").with_concurrency(1);
        let got = f
            .fetch(&keys(&["p/c/0/1", "p/c/9/9", "p/c/0/0"]), &Cancel::new())
            .unwrap();
        assert_eq!(got[0].as_deref(), Some(&b"one"[..]));
        assert_eq!(got[1], None);
        assert_eq!(got[2].as_deref(), Some(&b"zero"[..]));
    }

    #[test]
    fn many_in_flight_keep_the_order() {
        let objects: Vec<(String, Vec<u8>)> = (0..300)
            .map(|i| (format!("s/v/c/{i}"), vec![(i % 251) as u8; 1 + i % 17]))
            .collect();
        let refs: Vec<(&str, &[u8])> = objects
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        let f = Fetcher::new(store_with(&refs), "s");
        let wanted: Vec<String> = (0..300).rev().map(|i| format!("v/c/{i}")).collect();
        let got = f.fetch(&wanted, &Cancel::new()).unwrap();
        for (k, g) in wanted.iter().zip(&got) {
            let i: usize = k.rsplit('/').next().unwrap().parse().unwrap();
            assert_eq!(g.as_deref(), Some(objects[i].1.as_slice()), "{k}");
        }
    }

    #[test]
    fn a_cancelled_fetch_is_interrupted() {
        let f = Fetcher::new(store_with(&[("a", b"x")]), "");
        let cancel = Cancel::new();
        cancel.cancel();
        assert!(matches!(
            f.fetch(&keys(&["a"]), &cancel),
            Err(FetchError::Interrupted)
        ));
    }

    #[test]
    fn bad_addresses_and_settings_are_refused_by_name() {
        let e = Fetcher::s3("gs://b/x", &[]).err().unwrap().to_string();
        assert!(e.contains("not an s3://"), "{e}");
        let e = Fetcher::s3("s3:///x", &[]).err().unwrap().to_string();
        assert!(e.contains("names no bucket"), "{e}");
        let bad = [("aws_no_such_thing".to_string(), "1".to_string())];
        let e = Fetcher::s3("s3://b/x", &bad).err().unwrap().to_string();
        assert!(e.contains("aws_no_such_thing"), "{e}");
    }

    #[test]
    fn an_unreachable_server_is_an_error_naming_the_object() {
        // Port 9 on the loopback: nothing listens, so the connection is refused at once.
        let config = [
            ("aws_endpoint_url", "http://127.0.0.1:9"),
            ("aws_allow_http", "true"),
            ("aws_access_key_id", "k"),
            ("aws_secret_access_key", "s"),
            ("aws_region", "us-east-1"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let f = Fetcher::s3("s3://bucket/run.zarr", &config).unwrap();
        let f = Fetcher {
            store: f.store,
            root: f.root,
            concurrency: 1,
        };
        match f.fetch(&keys(&["p/zarr.json"]), &Cancel::new()) {
            Err(FetchError::Request { key, .. }) => assert_eq!(key, "p/zarr.json"),
            other => panic!("expected a request error, got {:?}", other.map(|v| v.len())),
        }
    }
}
