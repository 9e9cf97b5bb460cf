//! The paged KV cache: page metadata on the scheduler's side ([`blocks`]: allocation,
//! reference counts, prefix cache, copy-on-write) and page bytes on the executor's side
//! ([`cache`]: per-layer INT8 "C8" or float slots, paged attention). One page id
//! addresses a page in every layer.

pub mod blocks;
pub mod cache;

pub use blocks::{salt_of, BlockManager, PageId, SeqId, Slot};
pub use cache::{KvCache, KvFloatDtype, KvScale};
