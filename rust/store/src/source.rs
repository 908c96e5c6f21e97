//! Where a store's chunk objects are: files of a local store, or objects the caller fetched
//! from object storage. This is all the two reads differ in: both hand a chunk's stored bytes
//! to the same decode and checks ([`crate::direct`]: crc32c verified, a missing object named,
//! the decoded size exact).

use std::collections::HashMap;
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::path::PathBuf;

use crate::Problem;

/// The stored chunk objects of one store, by key (relative to the store's root).
pub trait ChunkSource: Sync {
    /// The stored bytes of the object `key`, read into `scratch` where they must be read;
    /// [`Problem::Missing`] where it does not exist.
    fn stored<'a>(&'a self, key: &str, scratch: &'a mut Vec<u8>) -> Result<&'a [u8], Problem>;
}

/// The chunk files of a local store.
pub struct LocalFiles {
    root: PathBuf,
}

impl LocalFiles {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }
}

impl ChunkSource for LocalFiles {
    fn stored<'a>(&'a self, key: &str, scratch: &'a mut Vec<u8>) -> Result<&'a [u8], Problem> {
        let failed = |e: std::io::Error| Problem::Decode {
            key: key.to_string(),
            message: e.to_string(),
        };
        let mut f = match File::open(self.root.join(key)) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(Problem::Missing {
                    key: key.to_string(),
                })
            }
            Err(e) => return Err(failed(e)),
        };
        scratch.clear();
        f.read_to_end(scratch).map_err(failed)?;
        Ok(scratch)
    }
}

/// Chunk objects the caller fetched from object storage (many requests in flight, with its
/// own credentials and endpoint): their bytes by key, None where the object does not exist.
pub struct FetchedObjects<'a> {
    objects: HashMap<&'a str, Option<&'a [u8]>>,
}

impl<'a> FetchedObjects<'a> {
    pub fn new(objects: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>) -> Self {
        Self {
            objects: objects.into_iter().collect(),
        }
    }
}

impl ChunkSource for FetchedObjects<'_> {
    fn stored<'a>(&'a self, key: &str, _: &'a mut Vec<u8>) -> Result<&'a [u8], Problem> {
        match self.objects.get(key) {
            Some(Some(bytes)) => Ok(bytes),
            _ => Err(Problem::Missing {
                key: key.to_string(),
            }),
        }
    }
}
