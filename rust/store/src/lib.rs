//! kvcouple-store: the heavy half of reading a trace store, on the `zarrs` crate.
//!
//! Python's `kvcouple.store.reader.TraceStoreReader` decides *what* to read (it owns the store's
//! geometry and validation); this crate decodes the blocks it names — Zarr v2 or v3, sharded or
//! not, zstd/blosc/gzip/zlib or uncompressed — in parallel (rayon, in kvcouple's pool) and
//! consumes each block at once: decode `p` and `q`, recompute every row's TV, keep only the TVs.
//! Memory is a block pair per thread, whatever the store's size.
//!
//! A chunk file that is absent is an error here (Zarr would return its fill value), and so is
//! one that does not decode or fails its checksum (crc32c, or Zstd's frame checksum, always
//! verified); all name the chunk key. With a tolerance, every decoded row must be a
//! distribution (all NaN, or finite, >= 0 and summing to 1): the first that is not is named by
//! its chunk and index. An array zarrs cannot open (a codec it lacks) is reported as
//! unsupported so the caller can fall back to zarr-python.
//!
//! Blocks that are whole chunks of the layout kvcouple writes (zstd, crc32c) skip zarrs' codec
//! pipeline: [`direct`] decodes them into reused buffers that the kernels read in place.
//!
//! - [`source`]: where chunk objects are ([`source::ChunkSource`]: local files, or objects
//!   fetched from object storage), the one thing local and object-storage reads differ in;
//! - [`blocks`]: blocks checked, decoded in parallel and consumed into row TVs, written once;
//! - [`local`]: a local store's variable (zarrs for the layouts [`direct`] does not read);
//! - [`fetched`]: a variable on object storage, its blocks from the chunk objects fetched;
//! - [`chunks`]: whole chunks of the small variables, decoded as stored.

mod blocks;
pub use blocks::BlockOutput;
pub mod chunks;
mod direct;
pub mod fetched;
pub mod local;
pub mod shard_write;
pub mod source;

/// Why a read failed, with the chunk key where there is one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Problem {
    #[error("chunk {key} is missing")]
    Missing { key: String },
    #[error("chunk {key} cannot be decoded ({message})")]
    Decode { key: String, message: String },
    /// The chunk's bytes do not match their stored checksum.
    #[error("chunk {key} fails its checksum ({message})")]
    Checksum { key: String, message: String },
    /// A decoded row is not a distribution: element `index` (one entry per axis; for a bad
    /// sum the last entry is -1) holds `value` (`what` is "entry" or "sum").
    #[error("chunk {key} holds {value} at {index:?} ({what})")]
    Value {
        key: String,
        index: Vec<i64>,
        value: f64,
        what: &'static str,
    },
    #[error("{message}")]
    Unsupported { message: String },
}
