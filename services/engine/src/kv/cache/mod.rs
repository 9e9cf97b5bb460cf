//! KV-cache storage: the bytes behind the pages the block manager hands out.
//!
//! One page id addresses the same page in every layer. Each layer writes new tokens in its
//! current precision: INT8 ("C8": symmetric, zero point 0, one scale = max|x|/127 per
//! token) or float (f16 by default, f32 for exactness tests). A layer can switch at any
//! step. Tokens already written keep the precision they were written in — every slot
//! carries a tag — and are read with their C8 scale (1 for a float row), so a page may
//! hold both kinds. Nothing is
//! rewritten on a switch: the switch is free and takes effect for the next token.

use crate::kv::blocks::{PageId, Slot};
use half::f16;

mod attend;
pub use quantmesh_config::{KvFloatDtype, KvScale};

const EMPTY: u8 = 0;
const INT8: u8 = 1;
const FLOAT: u8 = 2;

#[derive(Debug, Clone)]
enum FloatBuf {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl FloatBuf {
    fn new(dtype: KvFloatDtype, n: usize) -> Self {
        match dtype {
            KvFloatDtype::F16 => FloatBuf::F16(vec![f16::ZERO; n]),
            KvFloatDtype::F32 => FloatBuf::F32(vec![0.0; n]),
        }
    }
    fn write(&mut self, at: usize, x: &[f32]) {
        match self {
            FloatBuf::F16(b) => b[at..at + x.len()]
                .iter_mut()
                .zip(x)
                .for_each(|(d, s)| *d = f16::from_f32(*s)),
            FloatBuf::F32(b) => b[at..at + x.len()].copy_from_slice(x),
        }
    }
    fn read(&self, at: usize, out: &mut [f32]) {
        match self {
            FloatBuf::F16(b) => {
                let n = out.len();
                out.iter_mut()
                    .zip(&b[at..at + n])
                    .for_each(|(d, s)| *d = s.to_f32())
            }
            FloatBuf::F32(b) => {
                let n = out.len();
                out.copy_from_slice(&b[at..at + n])
            }
        }
    }
    fn bytes(&self) -> usize {
        match self {
            FloatBuf::F16(b) => b.len() * 2,
            FloatBuf::F32(b) => b.len() * 4,
        }
    }
}

#[derive(Debug, Clone)]
struct Quant {
    k: Vec<i8>,
    v: Vec<i8>,
    k_scale: Vec<f32>,
    v_scale: Vec<f32>,
}

/// One page of one layer. Buffers for each precision are allocated on first use.
#[derive(Debug, Clone, Default)]
struct PageData {
    tag: Vec<u8>,
    quant: Option<Quant>,
    float: Option<(FloatBuf, FloatBuf)>,
}

/// Quantize one token's vector: returns the scale (max|x|/127; 0 for an all-zero vector).
pub fn quantize_c8(x: &[f32], out: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        out.iter_mut().for_each(|o| *o = 0);
        return 0.0;
    }
    let scale = amax / 127.0;
    let inv = 1.0 / scale;
    for (o, v) in out.iter_mut().zip(x) {
        *o = round_half_away(v * inv).clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// `x.round()` (halves away from zero) for `|x| < 2²³`, and 0 for NaN (where `round` gives
/// NaN, which becomes 0 as an integer all the same), without a call to the C library's
/// `roundf`, so the loop over a row vectorizes: `x − trunc(x)` is exact in that range.
#[inline(always)]
fn round_half_away(x: f32) -> f32 {
    let t = (x as i32) as f32;
    let f = x - t;
    t + if f >= 0.5 {
        1.0
    } else if f <= -0.5 {
        -1.0
    } else {
        0.0
    }
}

pub struct KvCache {
    page_size: usize,
    kv_dim: usize,
    float_dtype: KvFloatDtype,
    /// Channels per C8 scale (divides `kv_dim`).
    scale_width: usize,
    /// `layers[l][page]`
    layers: Vec<Vec<PageData>>,
}

impl KvCache {
    pub fn new(
        num_layers: usize,
        num_pages: usize,
        page_size: usize,
        kv_dim: usize,
        float_dtype: KvFloatDtype,
    ) -> Self {
        Self {
            page_size,
            kv_dim,
            float_dtype,
            scale_width: kv_dim,
            layers: (0..num_layers)
                .map(|_| vec![PageData::default(); num_pages])
                .collect(),
        }
    }

    /// C8 scales per token as `scale` says for heads `head_dim` wide (default: one per
    /// token). A `head_dim` that does not divide `kv_dim` keeps one scale per token.
    pub fn with_scale(mut self, scale: KvScale, head_dim: usize) -> Self {
        let n = scale.count(self.kv_dim, head_dim);
        if n > 0 && n * head_dim == self.kv_dim {
            self.scale_width = self.kv_dim / n;
        }
        self
    }

    /// Scales per token vector.
    fn scales(&self) -> usize {
        self.kv_dim / self.scale_width
    }

    /// Bytes one token occupies in one layer (K and V) in each precision.
    pub fn bytes_per_token_layer(&self, int8: bool) -> usize {
        Self::bytes_per_token_layer_for(self.kv_dim, self.scales(), self.float_dtype, int8)
    }

    /// [`KvCache::bytes_per_token_layer`] for a cache of this geometry, without one.
    pub fn bytes_per_token_layer_for(
        kv_dim: usize,
        scales: usize,
        float_dtype: KvFloatDtype,
        int8: bool,
    ) -> usize {
        if int8 {
            2 * (kv_dim + 4 * scales)
        } else {
            let w = match float_dtype {
                KvFloatDtype::F16 => 2,
                KvFloatDtype::F32 => 4,
            };
            2 * kv_dim * w
        }
    }

    /// Bytes currently allocated for page buffers.
    pub fn allocated_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|p| {
                p.tag.len()
                    + p.quant.as_ref().map_or(0, |q| {
                        q.k.len() + q.v.len() + 4 * (q.k_scale.len() + q.v_scale.len())
                    })
                    + p.float.as_ref().map_or(0, |(k, v)| k.bytes() + v.bytes())
            })
            .sum()
    }

    /// Write one token's K and V into `slot` of `layer`, in INT8 when `int8`.
    pub fn write(&mut self, layer: usize, slot: Slot, k: &[f32], v: &[f32], int8: bool) {
        let (ps, d, dtype) = (self.page_size, self.kv_dim, self.float_dtype);
        let (w, ns) = (self.scale_width, self.scales());
        let page = &mut self.layers[layer][slot.page as usize];
        if page.tag.is_empty() {
            page.tag = vec![EMPTY; ps];
        }
        let at = slot.offset * d;
        if int8 {
            let q = page.quant.get_or_insert_with(|| Quant {
                k: vec![0; ps * d],
                v: vec![0; ps * d],
                k_scale: vec![0.0; ps * ns],
                v_scale: vec![0.0; ps * ns],
            });
            for c in 0..ns {
                let (lo, hi) = (c * w, (c + 1) * w);
                q.k_scale[slot.offset * ns + c] =
                    quantize_c8(&k[lo..hi], &mut q.k[at + lo..at + hi]);
                q.v_scale[slot.offset * ns + c] =
                    quantize_c8(&v[lo..hi], &mut q.v[at + lo..at + hi]);
            }
            page.tag[slot.offset] = INT8;
        } else {
            let (fk, fv) = page.float.get_or_insert_with(|| {
                (FloatBuf::new(dtype, ps * d), FloatBuf::new(dtype, ps * d))
            });
            fk.write(at, k);
            fv.write(at, v);
            page.tag[slot.offset] = FLOAT;
        }
    }

    /// The first `len` tokens of a sequence with block table `table`, as `[len, kv_dim]`
    /// row-major K and V, dequantized where stored in INT8 (each run of channels that shares
    /// a C8 scale read as attention reads it, times its scale).
    pub fn gather(&self, layer: usize, table: &[PageId], len: usize) -> (Vec<f32>, Vec<f32>) {
        let (d, w) = (self.kv_dim, self.scale_width);
        let mut k = vec![0f32; len * d];
        let mut v = vec![0f32; len * d];
        let isa = quantmesh_kernels::Isa::current();
        let runs = k.chunks_exact_mut(w).zip(v.chunks_exact_mut(w)).enumerate();
        for (run, (ko, vo)) in runs {
            let (pos, g) = (run / (d / w), run % (d / w));
            self.read_ints(layer, table, pos, g, ko, vo, isa);
            let (ks, vs) = self.row_scales(layer, table, pos, g, w);
            ko.iter_mut().for_each(|x| *x *= ks);
            vo.iter_mut().for_each(|x| *x *= vs);
        }
        (k, v)
    }

    /// Precision tags of the first `len` tokens (`Some(true)` = INT8), for tests and metrics.
    pub fn slot_precisions(&self, layer: usize, table: &[PageId], len: usize) -> Vec<Option<bool>> {
        (0..len)
            .map(|pos| {
                let page = &self.layers[layer][table[pos / self.page_size] as usize];
                match page.tag.get(pos % self.page_size).copied().unwrap_or(EMPTY) {
                    INT8 => Some(true),
                    FLOAT => Some(false),
                    _ => None,
                }
            })
            .collect()
    }

    /// Copy-on-write: duplicate page `src` into `dst` in every layer.
    pub fn copy_page(&mut self, src: PageId, dst: PageId) {
        for layer in &mut self.layers {
            layer[dst as usize] = layer[src as usize].clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c8_round_trip_error_is_bounded_by_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let mut q = vec![0i8; 64];
        let s = quantize_c8(&x, &mut q);
        for (a, b) in x.iter().zip(&q) {
            assert!((a - *b as f32 * s).abs() <= s / 2.0 + 1e-6);
        }
        let mut z = vec![1i8; 4];
        assert_eq!(quantize_c8(&[0.0; 4], &mut z), 0.0);
        assert_eq!(z, vec![0; 4]);
    }

    #[test]
    fn rounding_without_the_c_library_is_rust_s_round() {
        // Every half, its neighbours one ulp either side, and a dense sweep of the range a
        // C8 row reaches (|x| <= 127 after the scale), both signs.
        let mut xs: Vec<f32> = (-300..=300).map(|h| h as f32 / 2.0).collect();
        for h in xs.clone() {
            xs.extend([
                f32::from_bits(h.to_bits() + 1),
                f32::from_bits(h.to_bits().max(1) - 1),
            ]);
        }
        xs.extend((-1_000_000..=1_000_000).map(|i| i as f32 * 1.3e-4));
        xs.extend([
            0.0,
            -0.0,
            0.499_999_97,
            -0.499_999_97,
            8_388_607.5,
            -8_388_607.5,
        ]);
        for x in xs {
            assert_eq!(round_half_away(x), x.round(), "{x:e}");
        }
        assert_eq!(round_half_away(f32::NAN) as i8, f32::NAN.round() as i8);
    }

    #[test]
    fn switching_precision_keeps_old_tokens_readable() {
        let mut kv = KvCache::new(1, 2, 4, 8, KvFloatDtype::F32);
        let table = [1u32, 0];
        let tok =
            |i: usize| -> Vec<f32> { (0..8).map(|j| (i * 8 + j) as f32 / 10.0 - 2.0).collect() };
        for pos in 0..6 {
            let int8 = pos < 3; // switch to float after 3 tokens, mid-page
            let slot = Slot {
                page: table[pos / 4],
                offset: pos % 4,
            };
            kv.write(0, slot, &tok(pos), &tok(pos + 100), int8);
        }
        let (k, v) = kv.gather(0, &table, 6);
        for pos in 0..6 {
            let want = tok(pos);
            let tol = if pos < 3 { 6.0 / 127.0 } else { 0.0 };
            for j in 0..8 {
                assert!((k[pos * 8 + j] - want[j]).abs() <= tol, "pos {pos}");
            }
            assert!((v[pos * 8] - tok(pos + 100)[0]).abs() <= tol.max(1e-6) * 30.0);
        }
        assert_eq!(
            kv.slot_precisions(0, &table, 6),
            vec![
                Some(true),
                Some(true),
                Some(true),
                Some(false),
                Some(false),
                Some(false)
            ]
        );
        assert!(kv.bytes_per_token_layer(true) < kv.bytes_per_token_layer(false));
    }

    #[test]
    fn paged_attention_matches_naive_softmax() {
        // 2 KV heads, 4 query heads (GQA rep 2), head_dim 4, 7 tokens over pages of 3.
        let (nkv, nh, hd, n) = (2, 4, 4, 7);
        let mut kv = KvCache::new(1, 4, 3, nkv * hd, KvFloatDtype::F32);
        let table = [2u32, 0, 3];
        let val = |t: usize, c: usize, salt: f32| ((t * 13 + c * 7) as f32 * 0.37 + salt).sin();
        for t in 0..n {
            let k: Vec<f32> = (0..nkv * hd).map(|c| val(t, c, 0.1)).collect();
            let v: Vec<f32> = (0..nkv * hd).map(|c| val(t, c, 0.9)).collect();
            kv.write(
                0,
                Slot {
                    page: table[t / 3],
                    offset: t % 3,
                },
                &k,
                &v,
                false,
            );
        }
        let start = 4;
        let m = n - start;
        let q: Vec<f32> = (0..m * nh * hd).map(|i| (i as f32 * 0.21).cos()).collect();
        let mut out = vec![0f32; m * nh * hd];
        kv.attend(0, &table, start, &q, m, nh, hd, &mut out)
            .unwrap();
        for i in 0..m {
            for h in 0..nh {
                let g = h / (nh / nkv);
                let qh = &q[(i * nh + h) * hd..][..hd];
                let ctx = start + i + 1;
                let scores: Vec<f32> = (0..ctx)
                    .map(|j| {
                        (0..hd)
                            .map(|d| qh[d] * val(j, g * hd + d, 0.1))
                            .sum::<f32>()
                            / (hd as f32).sqrt()
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f32 = e.iter().sum();
                for d in 0..hd {
                    let want: f32 = (0..ctx).map(|j| e[j] / z * val(j, g * hd + d, 0.9)).sum();
                    let got = out[(i * nh + h) * hd + d];
                    assert!((want - got).abs() < 1e-5, "q{i} h{h} d{d}: {got} vs {want}");
                }
            }
        }
    }

    /// The gather buffers are a thread's scratch, reused across calls: attending a short
    /// sequence after a longer one (INT8 and float pages, other values) gives the same bits
    /// as on a thread that attended nothing before.
    #[test]
    fn attention_after_a_longer_sequence_matches_a_fresh_thread() {
        let (nkv, nh, hd) = (2, 4, 8);
        let cache = move |n: usize, salt: f32, int8: bool| {
            let mut kv = KvCache::new(1, 8, 4, nkv * hd, KvFloatDtype::F32);
            let table: Vec<PageId> = (0..n.div_ceil(4) as PageId).collect();
            for t in 0..n {
                let row = move |s: f32| -> Vec<f32> {
                    (0..nkv * hd)
                        .map(|c| ((t * 11 + c * 5) as f32 * 0.29 + s + salt).sin())
                        .collect()
                };
                let slot = Slot {
                    page: table[t / 4],
                    offset: t % 4,
                };
                kv.write(0, slot, &row(0.3), &row(1.7), int8 && t % 3 != 0);
            }
            (kv, table)
        };
        let short = move || {
            let (kv, table) = cache(5, 0.0, true);
            let q: Vec<f32> = (0..2 * nh * hd).map(|i| (i as f32 * 0.17).cos()).collect();
            let mut out = vec![0f32; 2 * nh * hd];
            kv.attend(0, &table, 3, &q, 2, nh, hd, &mut out).unwrap();
            out
        };
        let fresh = std::thread::spawn(short).join().unwrap();
        let after_long = std::thread::spawn(move || {
            let (kv, table) = cache(29, 5.0, false);
            let q: Vec<f32> = (0..nh * hd).map(|i| (i as f32 * 0.41).sin()).collect();
            let mut out = vec![0f32; nh * hd];
            kv.attend(0, &table, 28, &q, 1, nh, hd, &mut out).unwrap();
            short()
        })
        .join()
        .unwrap();
        assert_eq!(
            fresh.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            after_long.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    /// Per-head C8 scales: a head of small values next to a head with a large channel keeps
    /// its own grid (error bounded by half of *its* step, not the large head's), both in
    /// `gather` (whole rows) and in attention's per-head reads; the scales cost 4 bytes per
    /// head per vector; per-token scales on the same data show the coarse grid.
    #[test]
    fn per_head_scales_keep_a_quiet_head_on_its_own_grid() {
        let (nkv, hd) = (3, 8);
        let d = nkv * hd;
        // head 0 quiet (|x| ≤ 0.1), head 1 carries a channel of 50, head 2 ordinary (≤ 1)
        let tok: Vec<f32> = (0..d)
            .map(|j| match j / hd {
                0 => 0.1 * ((j as f32) * 0.7).sin(),
                1 if j % hd == 3 => 50.0,
                _ => ((j as f32) * 1.3).cos(),
            })
            .collect();
        let max_err = |kv: &KvCache, head: usize| {
            let (k, v) = kv.gather(0, &[0], 1);
            (head * hd..(head + 1) * hd)
                .map(|j| (k[j] - tok[j]).abs().max((v[j] - tok[j]).abs()))
                .fold(0f32, f32::max)
        };
        let write = |scale| {
            let mut kv = KvCache::new(1, 1, 4, d, KvFloatDtype::F32).with_scale(scale, hd);
            kv.write(0, Slot { page: 0, offset: 0 }, &tok, &tok, true);
            kv
        };
        let (per_head, per_token) = (write(KvScale::Head), write(KvScale::Token));
        let half_step = |amax: f32| amax / 127.0 / 2.0 + 1e-7;
        assert!(max_err(&per_head, 0) <= half_step(0.1));
        assert!(max_err(&per_head, 1) <= half_step(50.0));
        assert!(max_err(&per_head, 2) <= half_step(1.0));
        // per token, the quiet head rounds on the loud head's grid: most of it reads 0
        assert!(max_err(&per_token, 0) > half_step(0.1) * 10.0);
        // attention's per-head read (integers, then the head's scale) decodes the same
        // values as `gather`
        let (mut k, mut v) = (vec![0f32; hd], vec![0f32; hd]);
        let isa = quantmesh_kernels::Isa::current();
        per_head.read_ints(0, &[0], 0, 2, &mut k, &mut v, isa);
        let (ks, _) = per_head.row_scales(0, &[0], 0, 2, hd);
        k.iter_mut().for_each(|x| *x *= ks);
        let (gk, _) = per_head.gather(0, &[0], 1);
        assert_eq!(k, gk[2 * hd..3 * hd]);
        assert_eq!(
            per_head.bytes_per_token_layer(true),
            per_token.bytes_per_token_layer(true) + 2 * 4 * (nkv - 1)
        );
        assert_eq!(
            KvCache::bytes_per_token_layer_for(
                d,
                KvScale::Head.count(d, hd),
                KvFloatDtype::F32,
                true
            ),
            per_head.bytes_per_token_layer(true)
        );
    }
}
