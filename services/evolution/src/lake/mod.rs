//! The Parquet lake: `<root>/<table>/model=<model>/date=<YYYY-MM-DD>/<file>.parquet` on an
//! object store (a local directory by default; `s3://`, `gs://`, `az://` with the `cloud`
//! feature).
//!
//! **File names carry the Kafka offsets they hold**:
//! `p<partition>-o<first>-<last>-<topic>.parquet` (offsets zero-padded to 20 digits). That is
//! what makes ingest exactly-once in the readers' view although Kafka delivery is
//! at-least-once: offsets are committed only after the files are durable, so after a crash
//! the consumer resumes at the first offset of a batch whose files may already exist; before
//! writing a batch starting at offset F, the ingester deletes every file of that
//! topic/partition whose first offset is ≥ F ([`Lake::supersede`]), then writes the new
//! ones. Objects are written whole (the local store writes a staging file and renames it),
//! and leftover staging files are swept at start ([`Lake::sweep`]).

pub mod tables;

use bytes::Bytes;
use datafusion::arrow::array::RecordBatch;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::{Compression, ZstdLevel};
use datafusion::parquet::file::properties::WriterProperties;
use futures::TryStreamExt;
use lake_store::path::Path as ObjPath;
use lake_store::{ObjectStore, ObjectStoreExt, PutPayload};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
pub use tables::Table;

#[derive(Debug, thiserror::Error)]
pub enum LakeError {
    #[error("bad lake location {0:?}: {1}")]
    BadLocation(String, String),
    #[error("lake {0}: {1}")]
    Io(String, String),
    #[error("encoding {0}: {1}")]
    Encode(String, String),
}

/// The lake's files by Kafka (topic, partition): each file's first offset and path.
type FileIndex = BTreeMap<(String, i32), Vec<(i64, ObjPath)>>;

/// Which Kafka records a file holds.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Source {
    pub topic: String,
    pub partition: i32,
    pub first: i64,
    pub last: i64,
}

impl Source {
    pub fn file_name(&self) -> String {
        format!(
            "p{}-o{:020}-{:020}-{}.parquet",
            self.partition, self.first, self.last, self.topic
        )
    }

    pub fn parse(name: &str) -> Option<Self> {
        let stem = name.strip_suffix(".parquet")?;
        let mut it = stem.splitn(4, '-');
        let partition = it.next()?.strip_prefix('p')?.parse().ok()?;
        let first = it.next()?.strip_prefix('o')?.parse().ok()?;
        let last = it.next()?.parse().ok()?;
        let topic = it.next()?.to_string();
        Some(Self {
            topic,
            partition,
            first,
            last,
        })
    }
}

/// The lake: an object store and the prefix of the tables in it, plus the index of the
/// files it holds (by source), kept current by this process.
pub struct Lake {
    store: Arc<dyn ObjectStore>,
    root: ObjPath,
    /// `scheme://authority` the store is registered under in DataFusion.
    base_url: url::Url,
    spec: String,
    index: Mutex<FileIndex>,
}

impl Lake {
    /// Open a lake at a local path or URL (created on first write).
    pub fn open(spec: &str) -> Result<Self, LakeError> {
        let bad = |m: String| LakeError::BadLocation(spec.to_string(), m);
        let url = if spec.contains("://") {
            url::Url::parse(spec).map_err(|e| bad(e.to_string()))?
        } else {
            let p = std::path::Path::new(spec);
            let abs = if p.is_absolute() {
                p.to_path_buf()
            } else {
                std::env::current_dir()
                    .map_err(|e| bad(format!("no current directory: {e}")))?
                    .join(p)
            };
            std::fs::create_dir_all(&abs).map_err(|e| bad(format!("creating it: {e}")))?;
            url::Url::from_directory_path(&abs).map_err(|_| bad("not an absolute path".into()))?
        };
        let (store, root) = lake_store::parse_url_opts(&url, quantmesh_store::cloud_env_options())
            .map_err(|e| {
                let msg = e.to_string();
                if msg.contains("not enabled") {
                    bad(format!(
                    "{msg}; this build writes local lakes only (rebuild with `--features cloud`)"
                ))
                } else {
                    bad(msg)
                }
            })?;
        let mut base_url = url.clone();
        base_url.set_path("/");
        base_url.set_query(None);
        Ok(Self {
            store: Arc::from(store),
            root,
            base_url,
            spec: url.to_string(),
            index: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn store(&self) -> Arc<dyn ObjectStore> {
        self.store.clone()
    }

    /// The store's `scheme://authority/` (what DataFusion registers it under).
    pub fn base_url(&self) -> &url::Url {
        &self.base_url
    }

    /// The URL of a table's directory (what a `ListingTable` reads).
    pub fn table_url(&self, table: Table) -> String {
        let mut u = self.base_url.clone();
        u.set_path(&format!("/{}/{}/", self.root, table.name()));
        u.to_string()
    }

    pub fn location(&self) -> &str {
        &self.spec
    }

    fn table_path(&self, table: Table) -> ObjPath {
        self.root.clone().join(table.name())
    }

    /// List the lake's Parquet files into the index, and delete staging leftovers (objects
    /// that are not `.parquet` files: a write interrupted before its rename). Returns the
    /// number of files indexed.
    pub async fn sweep(&self) -> Result<usize, LakeError> {
        let mut index: BTreeMap<(String, i32), Vec<(i64, ObjPath)>> = BTreeMap::new();
        let mut n = 0;
        for table in Table::ALL {
            let prefix = self.table_path(table);
            let metas: Vec<_> = self
                .store
                .list(Some(&prefix))
                .try_collect()
                .await
                .map_err(|e| LakeError::Io(prefix.to_string(), e.to_string()))?;
            for meta in metas {
                let name = meta.location.filename().unwrap_or_default().to_string();
                match Source::parse(&name) {
                    Some(src) => {
                        index
                            .entry((src.topic, src.partition))
                            .or_default()
                            .push((src.first, meta.location));
                        n += 1;
                    }
                    None => {
                        tracing::info!(target: "quantmesh::evolution", object = %meta.location, "removing an interrupted write");
                        let _ = self.store.delete(&meta.location).await;
                    }
                }
            }
        }
        if let Ok(mut i) = self.index.lock() {
            *i = index;
        }
        Ok(n)
    }

    /// Delete every file of `topic`/`partition` whose first offset is ≥ `first`: they hold
    /// records of a batch that was written but never committed (the consumer is about to
    /// write them again). Returns how many were deleted.
    pub async fn supersede(
        &self,
        topic: &str,
        partition: i32,
        first: i64,
    ) -> Result<usize, LakeError> {
        let stale: Vec<ObjPath> = {
            let Ok(mut index) = self.index.lock() else {
                return Ok(0);
            };
            let Some(files) = index.get_mut(&(topic.to_string(), partition)) else {
                return Ok(0);
            };
            let (stale, keep): (Vec<_>, Vec<_>) = files.drain(..).partition(|(f, _)| *f >= first);
            *files = keep;
            stale.into_iter().map(|(_, p)| p).collect()
        };
        for p in &stale {
            tracing::info!(target: "quantmesh::evolution", file = %p, "replacing a file of an uncommitted batch");
            match self.store.delete(p).await {
                Ok(()) | Err(lake_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(LakeError::Io(p.to_string(), e.to_string())),
            }
        }
        Ok(stale.len())
    }

    /// Write one Parquet file (zstd) for `table`, partition (`model`, `date`), holding the
    /// records of `source`. Returns the bytes written.
    pub async fn write(
        &self,
        table: Table,
        model_partition: &str,
        date: &str,
        source: &Source,
        batch: &RecordBatch,
    ) -> Result<u64, LakeError> {
        let path = self
            .table_path(table)
            .join(format!("model={model_partition}"))
            .join(format!("date={date}"))
            .join(source.file_name());
        let bytes = encode(batch).map_err(|e| LakeError::Encode(path.to_string(), e))?;
        let n = bytes.len() as u64;
        self.store
            .put(&path, PutPayload::from(bytes))
            .await
            .map_err(|e| LakeError::Io(path.to_string(), e.to_string()))?;
        if let Ok(mut i) = self.index.lock() {
            i.entry((source.topic.clone(), source.partition))
                .or_default()
                .push((source.first, path));
        }
        Ok(n)
    }

    /// Total bytes of the lake's Parquet files.
    pub async fn bytes(&self) -> Result<u64, LakeError> {
        let metas: Vec<_> = self
            .store
            .list(Some(&self.root))
            .try_collect()
            .await
            .map_err(|e| LakeError::Io(self.root.to_string(), e.to_string()))?;
        Ok(metas
            .iter()
            .filter(|m| m.location.as_ref().ends_with(".parquet"))
            .map(|m| m.size)
            .sum())
    }
}

fn encode(batch: &RecordBatch) -> Result<Bytes, String> {
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(3).map_err(|e| e.to_string())?,
        ))
        .set_created_by(format!("quantmesh-evolution {}", env!("CARGO_PKG_VERSION")))
        .build();
    let mut buf = Vec::new();
    let mut w =
        ArrowWriter::try_new(&mut buf, batch.schema(), Some(props)).map_err(|e| e.to_string())?;
    w.write(batch).map_err(|e| e.to_string())?;
    w.close().map_err(|e| e.to_string())?;
    Ok(Bytes::from(buf))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn file_names_round_trip() {
        let s = Source {
            topic: "quantmesh.monitor-windows.v1".into(),
            partition: 3,
            first: 17,
            last: 99,
        };
        assert_eq!(Source::parse(&s.file_name()), Some(s));
        assert_eq!(Source::parse("x.parquet#1"), None);
    }
}
