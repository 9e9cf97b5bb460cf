//! Reading checkpoints, memory-mapped, one tensor at a time, under Hugging Face tensor
//! names whatever the file format.
//!
//! Formats: Hugging Face safetensors, single (`model.safetensors`) or sharded
//! (`model.safetensors.index.json` mapping tensor names to shard files), and GGUF
//! (llama.cpp; see [`crate::gguf`]) whose tensors are dequantized by candle to their exact
//! float values. Every error names the file and, where it can be known, the tensor.

use crate::error::{ModelError, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use memmap2::Mmap;
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// One memory-mapped safetensors file (its header is validated when `Checkpoint::open`
/// indexes it).
struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

impl Shard {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path)
            .map_err(|e| ModelError::io(format!("opening {}", path.display()), e))?;
        // SAFETY: the checkpoint is mapped read-only; quantmesh never writes to a file it has
        // mapped, and a concurrent writer from outside is documented as unsupported (write
        // new checkpoints to a new directory).
        #[allow(unsafe_code)]
        let mmap = unsafe { Mmap::map(&file) }
            .map_err(|e| ModelError::io(format!("mapping {}", path.display()), e))?;
        Ok(Shard {
            path: path.to_path_buf(),
            mmap,
        })
    }

    fn diagnose(&self, err: safetensors::SafeTensorError) -> ModelError {
        let bytes = &self.mmap[..];
        if bytes.len() < 8 {
            return ModelError::checkpoint(
                &self.path,
                None,
                format!(
                    "file is {} bytes, too short for a safetensors header",
                    bytes.len()
                ),
            );
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&bytes[..8]);
        let header_len = u64::from_le_bytes(n) as usize;
        let Some(header) = bytes.get(8..8usize.saturating_add(header_len)) else {
            return ModelError::checkpoint(&self.path, None, format!("header claims {header_len} bytes but the file has {}: truncated or not a safetensors file ({err})", bytes.len()));
        };
        let Ok(meta) = serde_json::from_slice::<BTreeMap<String, serde_json::Value>>(header) else {
            return ModelError::checkpoint(
                &self.path,
                None,
                format!("header is not valid JSON ({err})"),
            );
        };
        let data_len = bytes.len() - 8 - header_len;
        // The first tensor (in file order) whose bytes are not all there.
        let mut spans: Vec<(String, usize)> = meta
            .iter()
            .filter(|(k, _)| k.as_str() != "__metadata__")
            .filter_map(|(k, v)| {
                let end = v.get("data_offsets")?.get(1)?.as_u64()? as usize;
                Some((k.clone(), end))
            })
            .collect();
        spans.sort_by_key(|(_, end)| *end);
        if let Some((name, end)) = spans.iter().find(|(_, end)| *end > data_len) {
            return ModelError::checkpoint(&self.path, Some(name), format!("data ends at byte {end} of the data section but the file holds only {data_len}: the file is truncated ({err})"));
        }
        ModelError::checkpoint(&self.path, None, format!("invalid safetensors file: {err}"))
    }

    /// Parse and validate the header; on failure, find the tensor the damage hits.
    fn tensors(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.mmap).map_err(|e| self.diagnose(e))
    }
}

/// Decode stored bytes into f32, rejecting NaN/Inf (`first` = index of the first element,
/// for the message).
fn decode_f32(
    data: &[u8],
    dtype: safetensors::Dtype,
    path: &Path,
    name: &str,
    first: usize,
) -> Result<Vec<f32>> {
    let values: Vec<f32> = match dtype {
        safetensors::Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        safetensors::Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        safetensors::Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(ModelError::checkpoint(
                path,
                Some(name),
                format!("unsupported dtype {other:?} (expected F32, F16 or BF16)"),
            ))
        }
    };
    if let Some(pos) = values.iter().position(|x| !x.is_finite()) {
        return Err(ModelError::checkpoint(
            path,
            Some(name),
            format!(
                "element {} is NaN or infinite: the file is corrupt",
                first + pos
            ),
        ));
    }
    Ok(values)
}

/// Dequantize `n` elements of GGUF data (exact: candle's dequantization of the stored
/// blocks), rejecting NaN/Inf.
fn decode_ggml(
    data: &[u8],
    dtype: GgmlDType,
    n: usize,
    path: &Path,
    name: &str,
    first: usize,
) -> Result<Vec<f32>> {
    let bad = |m: String| ModelError::checkpoint(path, Some(name), m);
    // candle reinterprets the bytes as blocks in place: they must be aligned (GGUF offsets
    // are, and `GgufFile::open` refuses a file whose offsets are not), and hold the blocks.
    if data.as_ptr().align_offset(std::mem::align_of::<u64>()) != 0 {
        return Err(bad("tensor data is not aligned".into()));
    }
    let blocks = n / dtype.block_size().max(1);
    if n == 0 || data.len() < blocks * dtype.type_size() {
        return Err(bad(format!(
            "{} bytes cannot hold {n} {dtype:?} elements",
            data.len()
        )));
    }
    let q =
        candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, data, vec![n], &Device::Cpu)
            .map_err(|e| bad(format!("{dtype:?} data: {e}")))?;
    let values = q
        .dequantize(&Device::Cpu)
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| bad(format!("dequantizing {dtype:?}: {e}")))?;
    if let Some(pos) = values.iter().position(|x| !x.is_finite()) {
        return Err(bad(format!(
            "element {} is NaN or infinite: the file is corrupt",
            first + pos
        )));
    }
    Ok(values)
}

/// Undo llama.cpp's q/k permutation: within each head, GGUF stores row `2i + t` for the
/// Hugging Face row `t * head_dim/2 + i` (interleaved RoPE pairs vs rotate-half).
fn unpermute_rows(values: Vec<f32>, shape: &[usize], heads: usize) -> Result<Vec<f32>, String> {
    let rows = shape.first().copied().unwrap_or(0);
    let cols: usize = shape.iter().skip(1).product::<usize>().max(1);
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(format!(
            "{rows} rows cannot be split into {heads} heads of even size"
        ));
    }
    let hd = rows / heads;
    let half = hd / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..half {
            for t in 0..2 {
                let src = (h * hd + 2 * i + t) * cols;
                let dst = (h * hd + t * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&values[src..src + cols]);
            }
        }
    }
    Ok(out)
}

/// Where a tensor lives and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// safetensors dtype name, e.g. `F32`, `BF16`.
    pub dtype: String,
    pub shape: Vec<usize>,
    pub file: PathBuf,
    pub bytes: usize,
}

/// How a tensor's bytes are stored.
#[derive(Debug, Clone, Copy)]
enum Stored {
    Safetensors(safetensors::Dtype),
    /// A GGUF tensor; `unpermute_heads` undoes llama.cpp's q/k row interleave.
    Ggml {
        dtype: GgmlDType,
        unpermute_heads: Option<usize>,
    },
}

impl Stored {
    fn name(&self) -> String {
        match self {
            Stored::Safetensors(d) => format!("{d:?}"),
            Stored::Ggml { dtype, .. } => format!("{dtype:?}"),
        }
    }
}

/// Where one tensor's bytes are: read from the shard headers once, at open.
struct Entry {
    shard: usize,
    dtype: Stored,
    shape: Vec<usize>,
    /// Byte range inside the shard's mapping.
    start: usize,
    end: usize,
}

impl TensorInfo {
    /// The line `layout_md5` hashes for this tensor: name, dtype and shape.
    pub fn layout_line(&self) -> String {
        format!("{}\t{}\t{:?}\n", self.name, self.dtype, self.shape)
    }
}

/// A checkpoint: one or more shards and the index of which tensor lives where.
pub struct Checkpoint {
    shards: Vec<Shard>,
    index: HashMap<String, Entry>,
}

impl Checkpoint {
    /// Open a checkpoint: a `.gguf` file or a directory holding one, else
    /// `dir/model.safetensors.index.json` if present, else every `*.safetensors` in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        if let Some(file) = crate::gguf::find_gguf(dir)? {
            return Self::from_gguf(&crate::gguf::GgufFile::open(&file)?);
        }
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| ModelError::io(format!("reading {}", index_path.display()), e))?;
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let idx: Index = serde_json::from_str(&text).map_err(|e| {
                ModelError::checkpoint(&index_path, None, format!("invalid index: {e}"))
            })?;
            let mut files: Vec<String> = idx.weight_map.values().cloned().collect();
            files.sort();
            files.dedup();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| ModelError::io(format!("listing {}", dir.display()), e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            files
        };
        if files.is_empty() {
            return Err(ModelError::checkpoint(
                dir,
                None,
                "no .safetensors files found",
            ));
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, path) in files.iter().enumerate() {
            let shard = Shard::open(path)?;
            let base = shard.mmap.as_ptr() as usize;
            for (name, view) in shard.tensors()?.iter() {
                let start = view.data().as_ptr() as usize - base;
                let entry = Entry {
                    shard: i,
                    dtype: Stored::Safetensors(view.dtype()),
                    shape: view.shape().to_vec(),
                    start,
                    end: start + view.data().len(),
                };
                if index.insert(name.to_string(), entry).is_some() {
                    return Err(ModelError::checkpoint(
                        path,
                        Some(name),
                        "tensor appears in more than one shard",
                    ));
                }
            }
            shards.push(shard);
        }
        Ok(Self { shards, index })
    }

    /// The GGUF file whose header is `gguf`: its tensors under their Hugging Face names.
    pub fn from_gguf(gguf: &crate::gguf::GgufFile) -> Result<Self> {
        let path = gguf.path.as_path();
        let shard = Shard::open(path)?;
        if shard.mmap.len() as u64 != gguf.file_len {
            return Err(ModelError::checkpoint(
                path,
                None,
                "the file changed while it was opened",
            ));
        }
        let index = gguf
            .tensors
            .iter()
            .map(|(name, t)| {
                let entry = Entry {
                    shard: 0,
                    dtype: Stored::Ggml {
                        dtype: t.dtype,
                        unpermute_heads: t.unpermute_heads,
                    },
                    shape: t.shape.clone(),
                    start: t.start,
                    end: t.end,
                };
                (name.clone(), entry)
            })
            .collect();
        Ok(Self {
            shards: vec![shard],
            index,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// A tensor's index entry and its shard; a missing name is a checkpoint error.
    fn entry(&self, name: &str) -> Result<(&Shard, &Entry)> {
        match self.index.get(name) {
            Some(e) => Ok((&self.shards[e.shard], e)),
            None => {
                let file = self
                    .shards
                    .first()
                    .map(|s| s.path.clone())
                    .unwrap_or_default();
                Err(ModelError::checkpoint(
                    file,
                    Some(name),
                    "tensor is missing from the checkpoint",
                ))
            }
        }
    }

    /// Every tensor's name, dtype and shape, in name order.
    pub fn layout(&self) -> Result<Vec<TensorInfo>> {
        let mut names: Vec<&String> = self.index.keys().collect();
        names.sort();
        names.into_iter().map(|name| self.info(name)).collect()
    }

    /// One tensor's name, dtype, shape, file and size.
    pub fn info(&self, name: &str) -> Result<TensorInfo> {
        let (shard, e) = self.entry(name)?;
        Ok(TensorInfo {
            name: name.to_string(),
            dtype: e.dtype.name(),
            shape: e.shape.clone(),
            file: shard.path.clone(),
            bytes: e.end - e.start,
        })
    }

    /// md5 (hex) over every tensor's name, dtype and shape in name order: identifies a
    /// checkpoint's layout without reading its data (`sensitive_layers.json`'s
    /// `model.layout_md5`).
    pub fn layout_md5(&self) -> Result<String> {
        let mut ctx = md5::Context::new();
        for t in self.layout()? {
            ctx.consume(t.layout_line().as_bytes());
        }
        Ok(format!("{:x}", ctx.finalize()))
    }

    /// Run `f` over a tensor's raw bytes as stored (for content hashing).
    pub fn with_bytes<R>(&self, name: &str, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let (shard, e) = self.entry(name)?;
        Ok(f(&shard.mmap[e.start..e.end]))
    }

    /// Check that a float or GGUF tensor holds no NaN/Inf, decoding it a bounded chunk at
    /// a time. Other dtypes are accepted as they are.
    pub fn verify(&self, name: &str) -> Result<()> {
        const CHUNK: usize = 1 << 20; // elements
        let (shard, e) = self.entry(name)?;
        let data = &shard.mmap[e.start..e.end];
        use safetensors::Dtype::{BF16, F16, F32};
        match e.dtype {
            Stored::Safetensors(dtype @ (F32 | F16 | BF16)) => {
                let width = dtype.bitsize() / 8;
                for (k, chunk) in data.chunks(CHUNK * width).enumerate() {
                    decode_f32(chunk, dtype, &shard.path, name, k * CHUNK)?;
                }
            }
            Stored::Safetensors(_) => {}
            Stored::Ggml { dtype, .. } => {
                let (block, size) = (dtype.block_size(), dtype.type_size());
                let step = (CHUNK / block).max(1);
                for (k, chunk) in data.chunks(step * size).enumerate() {
                    let n = chunk.len() / size * block;
                    decode_ggml(chunk, dtype, n, &shard.path, name, k * step * block)?;
                }
            }
        }
        Ok(())
    }

    /// The file a tensor lives in (for error messages).
    pub fn file_of(&self, name: &str) -> PathBuf {
        self.index
            .get(name)
            .map(|e| self.shards[e.shard].path.clone())
            .unwrap_or_default()
    }

    /// Tell the kernel the pages of `name` are not needed any more, so a scan over a
    /// checkpoint larger than RAM does not keep every page it has read resident (page cache
    /// stays; the process's resident set drops). Advisory: errors are ignored.
    pub fn release(&self, name: &str) {
        let Ok((shard, e)) = self.entry(name) else {
            return;
        };
        let page = 4096;
        let from = e.start.div_ceil(page) * page;
        let to = e.end / page * page;
        if to > from {
            // SAFETY: the mapping is a read-only file mapping; MADV_DONTNEED on it only drops
            // this process's references to the pages, which the kernel refills from the file
            // (page cache) on the next access. No slice into the range is held across this call.
            #[allow(unsafe_code)]
            let _ = unsafe {
                shard.mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    from,
                    to - from,
                )
            };
        }
    }

    /// Decode one tensor into f32 values (bf16/f16/f32 accepted) with one allocation of
    /// the result and no intermediate copy. Non-finite values are reported as corruption,
    /// naming the file and the tensor.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let (shard, e) = self.entry(name)?;
        let data = &shard.mmap[e.start..e.end];
        let values = match e.dtype {
            Stored::Safetensors(dtype) => decode_f32(data, dtype, &shard.path, name, 0)?,
            Stored::Ggml {
                dtype,
                unpermute_heads,
            } => {
                let n = e.shape.iter().product();
                let v = decode_ggml(data, dtype, n, &shard.path, name, 0)?;
                match unpermute_heads {
                    Some(heads) => unpermute_rows(v, &e.shape, heads)
                        .map_err(|m| ModelError::checkpoint(&shard.path, Some(name), m))?,
                    None => v,
                }
            }
        };
        Ok((values, e.shape.clone()))
    }

    /// Decode rows `start..start + n` of a tensor (rows = the first dimension) into f32,
    /// without touching the rest of it. With [`Checkpoint::release`] afterwards this walks a
    /// tensor larger than RAM in bounded memory.
    pub fn read_rows_f32(&self, name: &str, start: usize, n: usize) -> Result<Vec<f32>> {
        let (shard, e) = self.entry(name)?;
        let rows = e.shape.first().copied().unwrap_or(1);
        if start + n > rows {
            return Err(ModelError::checkpoint(
                &shard.path,
                Some(name),
                format!(
                    "rows {start}..{} requested, the tensor has {rows}",
                    start + n
                ),
            ));
        }
        let cols: usize = e.shape.iter().skip(1).product();
        match e.dtype {
            Stored::Safetensors(dtype) => {
                let width = (e.end - e.start) / (rows * cols).max(1);
                let from = e.start + start * cols * width;
                let bytes = &shard.mmap[from..from + n * cols * width];
                decode_f32(bytes, dtype, &shard.path, name, start * cols)
            }
            Stored::Ggml {
                dtype,
                unpermute_heads,
            } if cols.is_multiple_of(dtype.block_size()) => {
                // Rows are whole blocks. llama.cpp's q/k interleave stays inside a head, so
                // a permuted tensor is read in whole heads around the rows asked for.
                let (lo, hi) = match unpermute_heads {
                    Some(heads) if heads > 0 && rows.is_multiple_of(heads) => {
                        let hd = rows / heads;
                        (start / hd * hd, (start + n).div_ceil(hd) * hd)
                    }
                    // Heads that do not divide the rows: unpermute_rows names the problem.
                    Some(_) => (0, rows),
                    None => (start, start + n),
                };
                let row_bytes = cols / dtype.block_size() * dtype.type_size();
                let from = e.start + lo * row_bytes;
                let bytes = &shard.mmap[from..from + (hi - lo) * row_bytes];
                let mut v =
                    decode_ggml(bytes, dtype, (hi - lo) * cols, &shard.path, name, lo * cols)?;
                if let Some(heads) = unpermute_heads {
                    let span = heads * (hi - lo) / rows;
                    v = unpermute_rows(v, &[hi - lo, cols], span)
                        .map_err(|m| ModelError::checkpoint(&shard.path, Some(name), m))?;
                }
                Ok(v[(start - lo) * cols..(start - lo + n) * cols].to_vec())
            }
            // Blocks spanning rows: decode the whole tensor.
            Stored::Ggml { .. } => {
                let (all, _) = self.read_f32(name)?;
                Ok(all[start * cols..(start + n) * cols].to_vec())
            }
        }
    }

    /// Load one tensor as an f32 CPU tensor (see [`Checkpoint::read_f32`]).
    pub fn load_f32(&self, name: &str) -> Result<Tensor> {
        let (values, shape) = self.read_f32(name)?;
        Tensor::from_vec(values, shape, &Device::Cpu)
            .map_err(|e| ModelError::checkpoint(self.file_of(name), Some(name), e.to_string()))
    }

    /// Load a tensor and check its shape.
    pub fn load_f32_shaped(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.load_f32(name)?;
        if t.dims() != shape {
            return Err(ModelError::checkpoint(
                self.file_of(name),
                Some(name),
                format!(
                    "shape {:?} does not match the config's {:?}",
                    t.dims(),
                    shape
                ),
            ));
        }
        Ok(t)
    }
}

/// Write tensors (f32 data, stored in the given dtype) to one safetensors file.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    dtype: safetensors::Dtype,
) -> Result<()> {
    use safetensors::tensor::TensorView;
    let bufs: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, data)| match dtype {
            safetensors::Dtype::F16 => data
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
            safetensors::Dtype::BF16 => data
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
            _ => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        })
        .collect();
    let mut views = Vec::with_capacity(tensors.len());
    for ((name, shape, _), buf) in tensors.iter().zip(&bufs) {
        let view = TensorView::new(dtype, shape.clone(), buf)
            .map_err(|e| ModelError::checkpoint(path, Some(name), e.to_string()))?;
        views.push((name.clone(), view));
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::serialize_to_file(views, Some(meta), path)
        .map_err(|e| ModelError::checkpoint(path, None, format!("writing: {e}")))
}
