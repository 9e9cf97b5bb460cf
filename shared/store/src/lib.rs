//! Where quantmesh reads config from and publishes artefacts to, through the `object_store`
//! crate: a local path, `file://`, `memory://`, and — built with the `cloud` feature —
//! `s3://`, `gs://`, `az://` (credentials from the usual `AWS_*`, `GOOGLE_*`, `AZURE_*`
//! environment variables).
//!
//! * [`Location`]: one object to read (the engine's `--sensitive-layers` source). When the
//!   object is a [`LatestPointer`], reading follows it one hop, so a source can name the
//!   `latest` pointer of a versioned prefix.
//! * [`VersionedStore`]: a prefix to publish into (`quantmesh prescreen --upload`). Every
//!   version is stored under its content hash and never overwritten; the `latest` pointer is
//!   written last, so a reader never sees a pointer to a missing object.

use bytes::Bytes;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("bad location {0:?}: {1}")]
    BadLocation(String, String),
    #[error("{0}: not found")]
    NotFound(String),
    #[error("{0}: {1}")]
    Io(String, String),
    #[error("{0}: not writable: {1}")]
    NotWritable(String, String),
}

/// A pointer object: `{"quantmesh_pointer": 1, "object": "versions/<md5>.json", "md5": ..}`,
/// `object` relative to the pointer's own prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatestPointer {
    pub quantmesh_pointer: u32,
    pub object: String,
    pub md5: String,
}

/// The cloud stores' settings from the environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`, as
/// object_store's builders name them, lower-cased), for `parse_url_opts`.
pub fn cloud_env_options() -> Vec<(String, String)> {
    std::env::vars()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .filter(|(k, _)| {
            ["aws_", "google_", "azure_"]
                .iter()
                .any(|p| k.starts_with(p))
        })
        .collect()
}

/// Parse a local path or URL into a store and the path inside it.
fn open(spec: &str) -> Result<(Arc<dyn ObjectStore>, ObjPath, String), StoreError> {
    let bad = |m: String| StoreError::BadLocation(spec.to_string(), m);
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
        url::Url::from_file_path(&abs).map_err(|_| bad("not an absolute path".into()))?
    };
    let (store, path) = object_store::parse_url_opts(&url, cloud_env_options()).map_err(|e| {
        let msg = e.to_string();
        if msg.contains("not enabled") {
            bad(format!(
                "{msg}; this build reads local paths, file:// and memory:// only \
                 (rebuild with `--features cloud` for s3://, gs://, az://)"
            ))
        } else {
            bad(msg)
        }
    })?;
    Ok((Arc::from(store), path, url.to_string()))
}

fn io(what: &str, e: object_store::Error) -> StoreError {
    match e {
        object_store::Error::NotFound { .. } => StoreError::NotFound(what.to_string()),
        e => StoreError::Io(what.to_string(), e.to_string()),
    }
}

/// One readable object.
#[derive(Clone)]
pub struct Location {
    store: Arc<dyn ObjectStore>,
    path: ObjPath,
    display: String,
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.display)
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.display)
    }
}

impl Location {
    pub fn parse(spec: &str) -> Result<Self, StoreError> {
        let (store, path, display) = open(spec)?;
        Ok(Self {
            store,
            path,
            display,
        })
    }

    /// Read the object's bytes; a [`LatestPointer`] is followed one hop.
    pub async fn read(&self) -> Result<Bytes, StoreError> {
        let bytes = self.read_raw(&self.path).await?;
        match serde_json::from_slice::<LatestPointer>(&bytes) {
            Ok(ptr) if ptr.quantmesh_pointer == 1 => {
                let parent: Vec<_> = self.path.parts().collect();
                let mut target: Vec<object_store::path::PathPart<'_>> =
                    parent[..parent.len().saturating_sub(1)].to_vec();
                target.extend(
                    ObjPath::parse(&ptr.object)
                        .map_err(|e| {
                            StoreError::Io(self.display.clone(), format!("bad pointer: {e}"))
                        })?
                        .parts()
                        .map(|p| p.as_ref().to_string().into()),
                );
                let target = ObjPath::from_iter(target);
                self.read_raw(&target).await
            }
            _ => Ok(bytes),
        }
    }

    async fn read_raw(&self, path: &ObjPath) -> Result<Bytes, StoreError> {
        let what = format!("{} ({path})", self.display);
        let got = self.store.get(path).await.map_err(|e| io(&what, e))?;
        got.bytes().await.map_err(|e| io(&what, e))
    }
}

/// A prefix that holds content-addressed versions and a `latest` pointer.
pub struct VersionedStore {
    store: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    display: String,
}

/// What [`VersionedStore::publish`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// Path of the version, relative to the prefix: `versions/<md5>.json`.
    pub object: String,
    pub md5: String,
    /// Full URL of the version and of the pointer.
    pub object_url: String,
    pub latest_url: String,
    /// False when the same content was already stored (publishing is idempotent).
    pub created: bool,
}

impl std::fmt::Display for Published {
    /// `<version url> (new version|already stored), latest -> <pointer url>`
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}), latest -> {}",
            self.object_url,
            if self.created {
                "new version"
            } else {
                "already stored"
            },
            self.latest_url
        )
    }
}

impl VersionedStore {
    pub fn parse(spec: &str) -> Result<Self, StoreError> {
        let (store, prefix, display) = open(spec)?;
        Ok(Self {
            store,
            prefix,
            display: display.trim_end_matches('/').to_string(),
        })
    }

    fn child(&self, rel: &str) -> ObjPath {
        let mut p: Vec<String> = self
            .prefix
            .parts()
            .map(|p| p.as_ref().to_string())
            .collect();
        p.extend(rel.split('/').map(str::to_string));
        ObjPath::from_iter(p)
    }

    /// Write and delete a probe object: fails early when the target is unreachable or
    /// read-only, before any expensive work.
    pub async fn check_writable(&self) -> Result<(), StoreError> {
        let probe = self.child(&format!(".quantmesh-probe-{}", std::process::id()));
        let fail =
            |e: object_store::Error| StoreError::NotWritable(self.display.clone(), e.to_string());
        self.store
            .put(&probe, PutPayload::from_static(b"probe"))
            .await
            .map_err(fail)?;
        self.store.delete(&probe).await.map_err(fail)?;
        Ok(())
    }

    /// Store `bytes` under `versions/<md5>.json` (never overwriting) and then point `latest`
    /// at it.
    pub async fn publish(&self, bytes: Bytes) -> Result<Published, StoreError> {
        let md5 = format!("{:x}", md5::compute(&bytes));
        let object = format!("versions/{md5}.json");
        let path = self.child(&object);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let created = match self.store.put_opts(&path, bytes.into(), opts).await {
            Ok(_) => true,
            // Content-addressed: an existing object has these very bytes.
            Err(object_store::Error::AlreadyExists { .. }) => false,
            Err(e) => return Err(io(&format!("{}/{object}", self.display), e)),
        };
        let ptr = LatestPointer {
            quantmesh_pointer: 1,
            object: object.clone(),
            md5: md5.clone(),
        };
        let ptr_bytes = serde_json::to_vec_pretty(&ptr)
            .map_err(|e| StoreError::Io(self.display.clone(), e.to_string()))?;
        self.store
            .put(&self.child("latest"), ptr_bytes.into())
            .await
            .map_err(|e| io(&format!("{}/latest", self.display), e))?;
        Ok(Published {
            object_url: format!("{}/{object}", self.display),
            latest_url: format!("{}/latest", self.display),
            object,
            md5,
            created,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn publish_is_content_addressed_and_latest_is_followed() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("file://{}/plans", dir.path().display());
        let vs = VersionedStore::parse(&url).unwrap();
        vs.check_writable().await.unwrap();
        let a = vs.publish(Bytes::from_static(b"{\"v\":1}")).await.unwrap();
        assert!(a.created);
        let again = vs.publish(Bytes::from_static(b"{\"v\":1}")).await.unwrap();
        assert!(!again.created);
        assert_eq!(a.object, again.object);
        let b = vs.publish(Bytes::from_static(b"{\"v\":2}")).await.unwrap();
        assert_ne!(a.object, b.object);
        // Both versions remain; latest names the newest.
        assert!(dir.path().join("plans").join(&a.object).exists());
        let latest = Location::parse(&b.latest_url).unwrap();
        assert_eq!(&latest.read().await.unwrap()[..], b"{\"v\":2}");
        // A plain local path reads the file itself.
        let plain =
            Location::parse(dir.path().join("plans").join(&a.object).to_str().unwrap()).unwrap();
        assert_eq!(&plain.read().await.unwrap()[..], b"{\"v\":1}");
    }

    #[tokio::test]
    async fn errors_are_clear() {
        let dir = tempfile::tempdir().unwrap();
        let missing = Location::parse(dir.path().join("nope.json").to_str().unwrap()).unwrap();
        assert!(matches!(missing.read().await, Err(StoreError::NotFound(_))));
        #[cfg(not(feature = "cloud"))]
        {
            let e = Location::parse("s3://bucket/x.json")
                .unwrap_err()
                .to_string();
            assert!(e.contains("--features cloud"), "{e}");
        }
        let e = Location::parse("not a scheme://x").unwrap_err();
        assert!(matches!(e, StoreError::BadLocation(..)), "{e}");
    }

    #[tokio::test]
    async fn unwritable_target_fails_the_probe() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        // A prefix under a regular file cannot hold objects.
        let vs = VersionedStore::parse(&format!("file://{}/sub", file.display())).unwrap();
        assert!(matches!(
            vs.check_writable().await,
            Err(StoreError::NotWritable(..))
        ));
    }
}
