//! Causal attention over one sequence's cached keys and values, all heads, on the pool.
//!
//! A work item is one query row and a group of up to [`MAX_GROUP`] query heads that share a
//! key/value head (grouped-query attention): each key and value row is loaded, and converted
//! from 8 bits, once for the whole group. For each head of the group: its scores against
//! every visible key, one max, one pass of exponentials, one weighted sum of the values
//! (two-pass softmax: no rescaling of the output per key). A head's result does not depend
//! on the group it was computed in, so the group size may follow the thread count. The
//! threads take the items in contiguous chunks from the last row back (longest first), so
//! the chunks taken last, which decide when the call ends, are the shortest. The loops are
//! written with 8 explicit lanes and fused multiply-adds, so the scalar build and the AVX2
//! build (the same code compiled with AVX2 and FMA enabled) round in the same places and
//! give the same bits.

#![allow(clippy::needless_range_loop)] // lane-indexed loops: the order of the additions is the contract

use crate::layout::Out;
use crate::pool::Pool;
use crate::{Isa, KernelError, Result};
use std::cell::RefCell;

/// The shapes of one call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query rows (the chunk's new tokens).
    pub rows: usize,
    /// Position of the first query row: row `i` sees keys `0 ..= start + i`.
    pub start: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// `out[i][h] = softmax(q[i][h] · K_gᵀ / √d) · V_g` over the keys row `i` may see, where
/// `g = h / (heads / kv_heads)` (grouped-query heads share a key/value head).
///
/// `q` and `out` are `[rows][heads][head_dim]`; `k` and `v` are `[kv_heads][keys][head_dim]`
/// with `keys ≥ start + rows`.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: AttentionShape,
    out: &mut [f32],
    isa: Isa,
    pool: &Pool,
) -> Result<()> {
    let AttentionShape {
        kv_heads,
        head_dim: hd,
        ..
    } = shape;
    let keys = if kv_heads == 0 || hd == 0 {
        0
    } else {
        k.len() / (kv_heads * hd)
    };
    if k.len() != keys * kv_heads * hd || v.len() != k.len() {
        return Err(KernelError::Shape(format!(
            "attention: k {} v {} values for {kv_heads} key/value heads of width {hd}",
            k.len(),
            v.len()
        )));
    }
    let kv = Contiguous {
        k,
        v,
        k_scales: None,
        v_scales: None,
        keys,
        head_dim: hd,
    };
    attention_over(q, &kv, shape, out, isa, pool)
}

/// [`attention`] over keys and values read from `kv`, each row times its scale:
/// `score_j = (q · k_j) · s^k_j / √d` and `out = Σ_j (p_j · s^v_j) · v_j / Σ_j p_j`. A row
/// of 8-bit values is read as its integers (exactly, in f32), so the same integers handed
/// over as f32 with the same scales give the same bits.
pub fn attention_over<S: KvSource>(
    q: &[f32],
    kv: &S,
    shape: AttentionShape,
    out: &mut [f32],
    isa: Isa,
    pool: &Pool,
) -> Result<()> {
    let AttentionShape {
        rows,
        start,
        heads,
        kv_heads,
        head_dim: hd,
    } = shape;
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || hd == 0 {
        return Err(KernelError::Shape(format!(
            "{heads} heads over {kv_heads} key/value heads of width {hd}"
        )));
    }
    let keys = kv.keys();
    if q.len() != rows * heads * hd || out.len() != q.len() || keys < start + rows {
        return Err(KernelError::Shape(format!(
            "attention: q {} / out {} for {rows} rows of {heads}x{hd}, {keys} keys for {start}+{rows} positions",
            q.len(),
            out.len(),
        )));
    }
    if rows * heads == 0 {
        return Ok(());
    }
    let isa = if isa.available() { isa } else { Isa::Scalar };
    // Below this much work one thread is faster than waking another. A call that would run on
    // this thread alone anyway (nested in a pool job: a decode step's sequences attended in
    // parallel) counts as one thread, so its heads form whole groups and each key and value
    // row is read once per key/value head (SmolLM2 at 32 streams: a decode step's attention
    // about 1 ms shorter than with the groups split for two threads).
    let serial = rows * heads * (start + rows) * hd < 16 * 1024 || pool.busy();
    let threads = if serial { 1 } else { pool.threads() };
    let groups = HeadGroups::new(rows, heads / kv_heads, kv_heads, threads);
    let items = groups.items(rows);
    let dst = Out(out.as_mut_ptr());
    let call = Call { q, kv, shape };
    let work = |range: std::ops::Range<usize>| {
        let dst = &dst;
        SCORES.with_borrow_mut(|scores| {
            scores.resize((MAX_GROUP * (start + rows)).max(scores.len()), 0.0);
            for item in range.map(|j| items - 1 - j) {
                let item = groups.item(item);
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `isa.available()` checked AVX-512F, AVX2 and FMA.
                    isa if isa.x86_avx512() => unsafe { call.item_avx512(item, scores, dst.0) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `isa.available()` checked AVX2 and FMA.
                    isa if isa.x86_simd() => unsafe { call.item_avx2(item, scores, dst.0) },
                    _ => call.item::<Portable>(item, scores, dst.0),
                }
            }
        });
    };
    pool.chunks(items, serial, &work);
    Ok(())
}

/// Query heads one item computes together at most.
const MAX_GROUP: usize = 4;

/// How a call's (row, head) pairs form items: the `rep` query heads of each of the
/// `kv_heads` key/value heads split into `per_kv_head` groups of at most `size` heads (the
/// last may be smaller).
#[derive(Debug, Clone, Copy)]
struct HeadGroups {
    kv_heads: usize,
    rep: usize,
    size: usize,
    per_kv_head: usize,
}

impl HeadGroups {
    /// Groups as large as [`MAX_GROUP`] allows, made smaller (down to one head) while the
    /// items would be fewer than two per thread, so a batch-1 decode step still spreads
    /// over the pool.
    fn new(rows: usize, rep: usize, kv_heads: usize, threads: usize) -> HeadGroups {
        let mut size = rep.clamp(1, MAX_GROUP);
        while size > 1 && rows * kv_heads * rep.div_ceil(size) < 2 * threads {
            size -= 1;
        }
        HeadGroups {
            kv_heads,
            rep,
            size,
            per_kv_head: rep.div_ceil(size),
        }
    }

    /// Work items for `rows` query rows.
    fn items(&self, rows: usize) -> usize {
        rows * self.kv_heads * self.per_kv_head
    }

    /// Work item number `item`.
    fn item(&self, item: usize) -> Item {
        let per_row = self.kv_heads * self.per_kv_head;
        let (i, rest) = (item / per_row, item % per_row);
        let (g, part) = (rest / self.per_kv_head, rest % self.per_kv_head);
        let first = part * self.size;
        Item {
            row: i,
            kv_head: g,
            first: g * self.rep + first,
            heads: self.size.min(self.rep - first),
        }
    }
}

/// One work item: query row `row`'s heads `first .. first + heads`, which all read
/// key/value head `kv_head`.
#[derive(Debug, Clone, Copy)]
struct Item {
    row: usize,
    kv_head: usize,
    first: usize,
    heads: usize,
}

/// A value type the cache keeps keys and values in: f32, or 8-bit integers read exactly.
pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Eight values from `p` as f32 (exactly as [`KvElem::to_f32`]).
    ///
    /// # Safety
    /// `p` points at 8 readable values, and AVX2 is available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen values from `p` as f32 (exactly as [`KvElem::to_f32`]).
    ///
    /// # Safety
    /// `p` points at 16 readable values, and AVX-512F is available.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl KvElem for i8 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (8 bytes; `_mm_loadl_epi64` reads exactly 8).
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (16 bytes).
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
    }
}

/// Consecutive rows of one key/value head: row `r` is `data[r · stride ..][..head_dim]`,
/// with scale `scales[r · scale_stride]` (a stride of 0 reads one scale for every row).
#[derive(Debug, Clone, Copy)]
pub struct KvRun<'a, E> {
    pub rows: usize,
    pub data: &'a [E],
    pub stride: usize,
    pub scales: &'a [f32],
    pub scale_stride: usize,
}

impl<E> KvRun<'_, E> {
    /// Ask the caches for the run's first `width` values of every row and their scales
    /// (`prefetcht0`, one per cache line), so a source whose runs lie apart (a paged
    /// cache's pages) can have the next runs on their way while the kernel reads this
    /// one. A hint only: it reads nothing into the program; nothing on other targets.
    #[inline]
    pub fn prefetch(&self, width: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let bytes = width * std::mem::size_of::<E>();
            for r in 0..self.rows {
                let row = self
                    .data
                    .as_ptr()
                    .wrapping_add(r * self.stride)
                    .cast::<i8>();
                for line in (0..bytes).step_by(64) {
                    // SAFETY: a prefetch is a hint that cannot fault, whatever the address;
                    // SSE is part of x86-64.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(line)) };
                }
                let scale = self.scales.as_ptr().wrapping_add(r * self.scale_stride);
                // SAFETY: as above.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(scale.cast::<i8>()) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = width;
    }

    #[inline(always)]
    fn row(&self, r: usize, hd: usize) -> &[E] {
        &self.data[r * self.stride..][..hd]
    }
    #[inline(always)]
    fn scale(&self, r: usize) -> f32 {
        self.scales[r * self.scale_stride]
    }
}

/// A sequence's keys and values as [`attention_over`] reads them: in runs of rows (a
/// contiguous buffer is one run; a paged cache gives a run per page), so the kernel walks
/// them without a gathered copy.
pub trait KvSource: Sync {
    type Elem: KvElem;
    /// Key positions held (the same for keys and values).
    fn keys(&self) -> usize;
    /// `f(run)` for consecutive runs that cover the first `n` rows of head `g`'s keys
    /// (`values: false`) or values (`values: true`), in order.
    fn runs<F: FnMut(KvRun<'_, Self::Elem>)>(&self, values: bool, g: usize, n: usize, f: F);
}

/// Scale 1 for every row (`scale_stride` 0): exact, so unscaled rows keep their bits.
const UNIT_SCALE: &[f32] = &[1.0];

/// Keys and values in two `[kv_heads][keys][head_dim]` buffers, with optional
/// `[kv_heads][keys]` scales (none: every scale is 1).
#[derive(Debug, Clone, Copy)]
pub struct Contiguous<'a, E> {
    pub k: &'a [E],
    pub v: &'a [E],
    pub k_scales: Option<&'a [f32]>,
    pub v_scales: Option<&'a [f32]>,
    pub keys: usize,
    pub head_dim: usize,
}

impl<E: KvElem> KvSource for Contiguous<'_, E> {
    type Elem = E;
    fn keys(&self) -> usize {
        self.keys
    }
    #[inline(always)]
    fn runs<F: FnMut(KvRun<'_, E>)>(&self, values: bool, g: usize, n: usize, mut f: F) {
        let (data, scales) = if values {
            (self.v, self.v_scales)
        } else {
            (self.k, self.k_scales)
        };
        let (scales, scale_stride) = match scales {
            Some(s) => (&s[g * self.keys..], 1),
            None => (UNIT_SCALE, 0),
        };
        f(KvRun {
            rows: n,
            data: &data[g * self.keys * self.head_dim..],
            stride: self.head_dim,
            scales,
            scale_stride,
        })
    }
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

struct Call<'a, S> {
    q: &'a [f32],
    kv: &'a S,
    shape: AttentionShape,
}

/// The loops of an item over `G` query heads. [`Portable`] is the reference; a SIMD form
/// must do the same operations in the same order for every head (the tests compare bits).
trait Loops {
    /// Every row's scores of a run: `scores[t · ctx + j + r] = (q_t · row_r · scale_r) ·
    /// scale` for each head `t`, each product as [`dot`] adds it (8 lanes of fused
    /// multiply-adds, then the lanes in a fixed order, then the rest in order).
    fn scores_run<const G: usize, E: KvElem>(
        q: &[&[f32]; G],
        run: &KvRun<'_, E>,
        scale: f32,
        scores: &mut [f32],
        at: (usize, usize),
    );
    /// The largest of `s`, NaN ignored.
    fn max(s: &[f32]) -> f32;
    /// `s ← exp(s − max)` in place; returns Σ s (8 lanes, then the lanes in a fixed order).
    fn exp_shifted(s: &mut [f32], max: f32) -> f32;
    /// `o_t += Σ_r p_t[r] · row_r` over the run's rows, in order, for each head `t`
    /// (`o` is the `G` heads' outputs, one after another), one fused multiply-add per value.
    fn weighted_run<const G: usize, E: KvElem>(p: &[&[f32]; G], run: &KvRun<'_, E>, o: &mut [f32]);
}

/// The portable loops (8 explicit lanes), compiled for whatever the build targets.
struct Portable;

impl Loops for Portable {
    #[inline(always)]
    fn scores_run<const G: usize, E: KvElem>(
        q: &[&[f32]; G],
        run: &KvRun<'_, E>,
        scale: f32,
        scores: &mut [f32],
        (ctx, j): (usize, usize),
    ) {
        let hd = q[0].len();
        for r in 0..run.rows {
            let ks = run.scale(r);
            for (t, q) in q.iter().enumerate() {
                scores[t * ctx + j + r] = dot(q, run.row(r, hd)) * ks * scale;
            }
        }
    }
    #[inline(always)]
    fn max(s: &[f32]) -> f32 {
        s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
    }
    #[inline(always)]
    fn exp_shifted(s: &mut [f32], max: f32) -> f32 {
        exp_shifted(s, max)
    }
    #[inline(always)]
    fn weighted_run<const G: usize, E: KvElem>(p: &[&[f32]; G], run: &KvRun<'_, E>, o: &mut [f32]) {
        let hd = o.len() / G;
        for (p, o) in p.iter().zip(o.chunks_exact_mut(hd)) {
            weighted_run(p, run, o)
        }
    }
}

// The common head widths' loops in x86 registers, and the items that run them
// (`Call::item_avx2`, `Call::item_avx512`).
#[cfg(target_arch = "x86_64")]
mod x86;

impl<S: KvSource> Call<'_, S> {
    /// One item with loops `L` (the portable ones, or a SIMD form that does the same
    /// operations in the same order).
    #[inline(always)]
    fn item<L: Loops>(&self, item: Item, scores: &mut [f32], out: *mut f32) {
        match item.heads {
            1 => self.group::<L, 1>(item, scores, out),
            2 => self.group::<L, 2>(item, scores, out),
            3 => self.group::<L, 3>(item, scores, out),
            _ => self.group::<L, MAX_GROUP>(item, scores, out),
        }
    }

    /// The item's `G` heads (`G` = `item.heads`), each as if alone: its scores in its own
    /// span of `scores`, its own max, exponentials and sum, its own output.
    #[inline(always)]
    fn group<L: Loops, const G: usize>(&self, item: Item, scores: &mut [f32], out: *mut f32) {
        let Item {
            row: i,
            kv_head: g,
            first,
            ..
        } = item;
        let s = &self.shape;
        let hd = s.head_dim;
        let ctx = s.start + i + 1;
        let q: [&[f32]; G] =
            std::array::from_fn(|t| &self.q[(i * s.heads + first + t) * hd..][..hd]);
        let scale = 1.0 / (hd as f32).sqrt();
        let scores = &mut scores[..G * ctx];
        let mut j = 0;
        self.kv.runs(false, g, ctx, |run| {
            L::scores_run(&q, &run, scale, scores, (ctx, j));
            j += run.rows;
        });
        let inv: [f32; G] = std::array::from_fn(|t| {
            let st = &mut scores[t * ctx..][..ctx];
            let sum = L::exp_shifted(st, L::max(st));
            if sum > 0.0 {
                1.0 / sum
            } else {
                0.0
            }
        });
        // SAFETY: the item owns these heads' span of row `i`'s output (heads `first ..
        // first + G` lie side by side), checked in `attention_over`.
        let o =
            unsafe { std::slice::from_raw_parts_mut(out.add((i * s.heads + first) * hd), G * hd) };
        o.fill(0.0);
        let mut j = 0;
        self.kv.runs(true, g, ctx, |run| {
            for t in 0..G {
                let p = &mut scores[t * ctx + j..][..run.rows];
                for (r, p) in p.iter_mut().enumerate() {
                    *p *= run.scale(r);
                }
            }
            let p: [&[f32]; G] = std::array::from_fn(|t| &scores[t * ctx + j..][..run.rows]);
            L::weighted_run(&p, &run, o);
            j += run.rows;
        });
        for (o, inv) in o.chunks_exact_mut(hd).zip(inv) {
            for o in o {
                *o *= inv;
            }
        }
    }
}

/// Σ a·b in 8 lanes of fused multiply-adds, then the lanes pairwise in order (the order two
/// rounds of `hadd` give, so a SIMD form can add several rows' lanes at once), then the rest.
#[inline(always)]
fn dot<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l].to_f32(), acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s = x.mul_add(y.to_f32(), s);
    }
    s
}

/// `s ← exp(s − max)` in place; returns Σ s.
#[inline(always)]
fn exp_shifted(s: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        for l in 0..8 {
            c[l] = exp_nonpositive(c[l] - max);
            acc[l] += c[l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for x in chunks.into_remainder() {
        *x = exp_nonpositive(*x - max);
        sum += *x;
    }
    sum
}

/// `o += Σ_r p_r · row_r` over the run's rows, in order, one fused multiply-add per value.
#[inline(always)]
fn weighted_run<E: KvElem>(p: &[f32], run: &KvRun<'_, E>, o: &mut [f32]) {
    let hd = o.len();
    for (r, &pr) in p.iter().enumerate() {
        for (o, &x) in o.iter_mut().zip(run.row(r, hd)) {
            *o = pr.mul_add(x.to_f32(), *o);
        }
    }
}

/// `eˣ` for `x ≤ 0` (softmax's shifted scores), to about 2 ulp: `x = n·ln2 + r`, a
/// degree-6 polynomial for `eʳ` (|r| ≤ ln2/2; Cephes' `expf` coefficients), `2ⁿ` from the
/// exponent bits. Branch-free, so it vectorizes. Below −87 (where `eˣ` < 1.7e-38) and for
/// `-inf` or NaN it returns 0.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2²³: adding it rounds to an integer
    let finite = x >= -87.0; // false for NaN and below
    let xc = if finite { x.min(0.0) } else { -87.0 };
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = ((((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * r
        * r)
        + r
        + 1.0;
    let two_n = f32::from_bits((((n as i32) + 127) << 23) as u32);
    if finite {
        p * two_n
    } else {
        0.0
    }
}
