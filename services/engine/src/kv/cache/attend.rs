//! Attention's reads of the cache: a decode step's INT8 pages walked in place, anything else
//! gathered per KV head first; both give the same bits.

use super::{KvCache, Quant, EMPTY, FLOAT, INT8};
use crate::kv::blocks::PageId;
use std::cell::RefCell;

thread_local! {
    /// [`KvCache::attend`]'s K/V gather buffers for long chunks and for sequences whose
    /// pages mix INT8 and float slots (values, then one scale per position and KV head),
    /// one set per thread (the pool's workers each attend sequences of a decode step),
    /// grown to the longest sequence seen.
    static ATTEND_SCRATCH: RefCell<GatherScratch> = const { RefCell::new(GatherScratch::new()) };
}

struct GatherScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    k_scales: Vec<f32>,
    v_scales: Vec<f32>,
}

impl GatherScratch {
    const fn new() -> Self {
        Self {
            k: Vec::new(),
            v: Vec::new(),
            k_scales: Vec::new(),
            v_scales: Vec::new(),
        }
    }
}

/// A sequence's INT8 pages of one layer as attention reads them in place: one run of rows
/// per page, each row's integers with its scale, nothing gathered or dequantized first.
struct C8Pages<'a> {
    pages: Vec<&'a Quant>,
    keys: usize,
    page_size: usize,
    kv_dim: usize,
    head_dim: usize,
    /// Channels per scale (a multiple of `head_dim`) and scales per token.
    scale_width: usize,
    scales: usize,
}

impl quantmesh_kernels::KvSource for C8Pages<'_> {
    type Elem = i8;
    fn keys(&self) -> usize {
        self.keys
    }
    #[inline(always)]
    fn runs<F: FnMut(quantmesh_kernels::KvRun<'_, i8>)>(
        &self,
        values: bool,
        g: usize,
        n: usize,
        mut f: F,
    ) {
        let pages = n.div_ceil(self.page_size).min(self.pages.len());
        for p in 1..=PREFETCH_PAGES.min(pages.saturating_sub(1)) {
            self.run(p, values, g, n).prefetch(self.head_dim);
        }
        for p in 0..pages {
            if p + PREFETCH_PAGES < pages {
                self.run(p + PREFETCH_PAGES, values, g, n)
                    .prefetch(self.head_dim);
            }
            f(self.run(p, values, g, n));
        }
    }
}

/// Pages ahead of the one attention reads whose rows [`C8Pages`] asks the caches for: each
/// page is an allocation of its own, so the hardware prefetcher, which follows a stream
/// within a memory page, starts every cache page cold (in a long batch-1 decode the reads
/// of K/V rows from memory were most of attention's time).
const PREFETCH_PAGES: usize = 2;

impl C8Pages<'_> {
    /// Page `p`'s rows of KV head `g` among the first `n` positions, keys or values.
    #[inline(always)]
    fn run(&self, p: usize, values: bool, g: usize, n: usize) -> quantmesh_kernels::KvRun<'_, i8> {
        let (at, scale_at) = (g * self.head_dim, g * self.head_dim / self.scale_width);
        let q = self.pages[p];
        let (data, scales) = if values {
            (&q.v, &q.v_scale)
        } else {
            (&q.k, &q.k_scale)
        };
        quantmesh_kernels::KvRun {
            rows: (n - p * self.page_size).min(self.page_size),
            data: &data[at..],
            stride: self.kv_dim,
            scales: &scales[scale_at..],
            scale_stride: self.scales,
        }
    }
}

/// Values per buffer from which [`KvCache::attend`] reads a sequence's keys and values on the
/// kernel pool rather than on the calling thread (below it, handing the rows out costs
/// about what it saves). Inside a step that already runs on the pool (a batch's sequences
/// attended in parallel) the read stays on its thread whatever the size.
const PARALLEL_READ_FROM: usize = 16 * 1024;

/// Query rows up to which [`KvCache::attend`] reads INT8 pages in place. Every (row, head)
/// item converts the keys it reads, so a long chunk (a prefill) is faster converting each
/// key once into the gathered buffer; both reads give the same bits. Measured with
/// SmolLM2-135M on 2 cores: in place, batch-1 decode at 512 positions ran 1.4–1.6× the
/// gathered read's speed, and a 512-token prefill chunk 0.8–0.9×.
const IN_PLACE_ROWS: usize = 16;

impl KvCache {
    /// Paged causal attention for one sequence, straight from the pages.
    ///
    /// `q` holds `m` query tokens at absolute positions `start..start + m`, laid out
    /// `[m, num_heads, head_dim]`; the result goes to `out` in the same layout. Query head
    /// `h` reads KV head `h / (num_heads / num_kv_heads)` (grouped-query attention, HF's
    /// `repeat_kv` order). Each query attends to positions `0..=its own`, and
    /// `quantmesh_kernels::attention_over` computes every (query row, head) pair on the
    /// kernel pool (two-pass softmax), each key's score and each value's weight times the
    /// row's C8 scale (1 for a float row).
    ///
    /// When every position is stored in INT8 (the usual case) and the chunk is short (a
    /// decode step), the kernel reads the integers where they lie in the pages, a run per
    /// page. Otherwise (a float slot, or a long chunk) the sequence's rows
    /// are first gathered per KV head into a contiguous scratch buffer: INT8 rows as their
    /// integers in f32 (exact), float rows as they are, with their scales beside them, so
    /// both paths compute the same operations on the same numbers and give the same bits.
    /// Every query row is computed the same way whatever the chunking, so a token's result
    /// does not depend on how its sequence was split into steps. An error means the shapes
    /// disagree with the cache's layout.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        layer: usize,
        table: &[PageId],
        start: usize,
        q: &[f32],
        m: usize,
        num_heads: usize,
        head_dim: usize,
        out: &mut [f32],
    ) -> Result<(), quantmesh_kernels::KernelError> {
        let hd = head_dim;
        let nkv = self.kv_dim / hd;
        let total = start + m;
        let isa = quantmesh_kernels::Isa::current();
        let shape = quantmesh_kernels::AttentionShape {
            rows: m,
            start,
            heads: num_heads,
            kv_heads: nkv,
            head_dim: hd,
        };
        let pool = quantmesh_kernels::Pool::global();
        if m <= IN_PLACE_ROWS {
            if let Some(pages) = self.c8_pages(layer, table, total, hd) {
                return quantmesh_kernels::attention_over(q, &pages, shape, out, isa, pool);
            }
        }
        self.attend_gathered(layer, table, q, shape, out, isa)
    }

    /// [`KvCache::attend`] for long chunks and for pages that mix INT8 and float slots: the
    /// rows read to their
    /// integers (INT8) or values (float) once per kv head (`[kv head][pos][hd]`) into this
    /// thread's scratch buffers, positions spread over the kernel pool for long sequences,
    /// with their scales beside them. `read_ints` writes every value, so the buffers are
    /// neither allocated nor zeroed per call.
    fn attend_gathered(
        &self,
        layer: usize,
        table: &[PageId],
        q: &[f32],
        shape: quantmesh_kernels::AttentionShape,
        out: &mut [f32],
        isa: quantmesh_kernels::Isa,
    ) -> Result<(), quantmesh_kernels::KernelError> {
        let (nkv, hd, total) = (shape.kv_heads, shape.head_dim, shape.start + shape.rows);
        let pool = quantmesh_kernels::Pool::global();
        ATTEND_SCRATCH.with(|scratch| {
            let sc = &mut *scratch.borrow_mut();
            sc.k.resize(nkv * total * hd, 0.0);
            sc.v.resize(nkv * total * hd, 0.0);
            sc.k_scales.resize(nkv * total, 0.0);
            sc.v_scales.resize(nkv * total, 0.0);
            pool.fill_rows(
                &mut sc.k,
                &mut sc.v,
                hd,
                PARALLEL_READ_FROM,
                &|row, k, v| {
                    let (g, j) = (row / total, row % total);
                    self.read_ints(layer, table, j, g, k, v, isa);
                },
            );
            for (row, (ks, vs)) in sc.k_scales.iter_mut().zip(&mut sc.v_scales).enumerate() {
                (*ks, *vs) = self.row_scales(layer, table, row % total, row / total, hd);
            }
            let kv = quantmesh_kernels::Contiguous {
                k: &sc.k[..],
                v: &sc.v[..],
                k_scales: Some(&sc.k_scales[..]),
                v_scales: Some(&sc.v_scales[..]),
                keys: total,
                head_dim: hd,
            };
            quantmesh_kernels::attention_over(q, &kv, shape, out, isa, pool)
        })
    }

    /// The first `total` positions' pages of `layer` as [`C8Pages`], or `None` when any of
    /// those positions is not stored in INT8.
    fn c8_pages(
        &self,
        layer: usize,
        table: &[PageId],
        total: usize,
        hd: usize,
    ) -> Option<C8Pages<'_>> {
        let ps = self.page_size;
        let pages = total.div_ceil(ps);
        let mut out = Vec::with_capacity(pages);
        for (p, &id) in table.get(..pages)?.iter().enumerate() {
            let page = &self.layers[layer][id as usize];
            let rows = (total - p * ps).min(ps);
            let q = page.quant.as_ref()?;
            if !page.tag.get(..rows)?.iter().all(|&t| t == INT8) {
                return None;
            }
            out.push(q);
        }
        Some(C8Pages {
            pages: out,
            keys: total,
            page_size: ps,
            kv_dim: self.kv_dim,
            head_dim: hd,
            scale_width: self.scale_width,
            scales: self.scales(),
        })
    }

    /// Token `pos`'s K and V for KV head `g` (`k.len()` wide, within one C8 scale) into `k`
    /// and `v`: an INT8 row as its integers (the scale is [`KvCache::row_scales`]'), a float
    /// row as it is stored, an empty slot as zeros.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn read_ints(
        &self,
        layer: usize,
        table: &[PageId],
        pos: usize,
        g: usize,
        k: &mut [f32],
        v: &mut [f32],
        isa: quantmesh_kernels::Isa,
    ) {
        let hd = k.len();
        let page = &self.layers[layer][table[pos / self.page_size] as usize];
        let off = pos % self.page_size;
        let at = off * self.kv_dim + g * hd;
        match (
            page.tag.get(off).copied().unwrap_or(EMPTY),
            &page.quant,
            &page.float,
        ) {
            (INT8, Some(q), _) => {
                // Equal lengths by construction: the kernels' shape checks hold.
                let _ = quantmesh_kernels::dequantize_i8(&q.k[at..at + hd], 1.0, k, isa);
                let _ = quantmesh_kernels::dequantize_i8(&q.v[at..at + hd], 1.0, v, isa);
            }
            (FLOAT, _, Some((fk, fv))) => {
                fk.read(at, k);
                fv.read(at, v);
            }
            _ => {
                k.fill(0.0);
                v.fill(0.0);
            }
        }
    }

    /// The K and V scales of token `pos`'s KV head `g` (`hd` wide): its C8 scales when
    /// stored in INT8, 1 otherwise.
    pub(super) fn row_scales(
        &self,
        layer: usize,
        table: &[PageId],
        pos: usize,
        g: usize,
        hd: usize,
    ) -> (f32, f32) {
        let page = &self.layers[layer][table[pos / self.page_size] as usize];
        let off = pos % self.page_size;
        match (page.tag.get(off).copied().unwrap_or(EMPTY), &page.quant) {
            (INT8, Some(q)) => {
                let si = off * self.scales() + g * hd / self.scale_width;
                (q.k_scale[si], q.v_scale[si])
            }
            _ => (1.0, 1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{KvFloatDtype, KvScale};
    use super::*;
    use crate::kv::blocks::Slot;

    /// INT8 pages read in place give the same bits as the same pages gathered first (the
    /// path a sequence with float slots takes), per-token and per-head scales, pages of
    /// several sizes, decode rows and prefill chunks; and a page holding one float slot
    /// sends the sequence down the gathered path, still close to the exact softmax.
    #[test]
    fn int8_pages_read_in_place_equal_the_gathered_read() {
        let (nkv, nh, hd, n) = (3, 9, 64, 41usize);
        let val = |t: usize, c: usize, salt: f32| ((t * 17 + c * 5) as f32 * 0.23 + salt).sin();
        for scale in [KvScale::Token, KvScale::Head] {
            for page_size in [1, 5, 16] {
                let pages = n.div_ceil(page_size);
                let mut kv = KvCache::new(1, pages + 1, page_size, nkv * hd, KvFloatDtype::F32)
                    .with_scale(scale, hd);
                // pages in a scrambled order
                let table: Vec<PageId> = (0..pages as PageId).rev().collect();
                for t in 0..n {
                    let k: Vec<f32> = (0..nkv * hd).map(|c| val(t, c, 0.4) * 3.0).collect();
                    let v: Vec<f32> = (0..nkv * hd).map(|c| val(t, c, 1.1)).collect();
                    let slot = Slot {
                        page: table[t / page_size],
                        offset: t % page_size,
                    };
                    kv.write(0, slot, &k, &v, true);
                }
                for (start, m) in [(n - 1, 1), (0, n), (13, 7)] {
                    let q: Vec<f32> = (0..m * nh * hd).map(|i| (i as f32 * 0.13).cos()).collect();
                    let mut a = vec![0f32; q.len()];
                    let (mut b, mut c) = (a.clone(), a.clone());
                    kv.attend(0, &table, start, &q, m, nh, hd, &mut c).unwrap();
                    let shape = quantmesh_kernels::AttentionShape {
                        rows: m,
                        start,
                        heads: nh,
                        kv_heads: nkv,
                        head_dim: hd,
                    };
                    let isa = quantmesh_kernels::Isa::current();
                    let pages = kv.c8_pages(0, &table, start + m, hd).unwrap();
                    let pool = quantmesh_kernels::Pool::global();
                    quantmesh_kernels::attention_over(&q, &pages, shape, &mut a, isa, pool)
                        .unwrap();
                    kv.attend_gathered(0, &table, &q, shape, &mut b, isa)
                        .unwrap();
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    let at = format!("{scale:?} pages of {page_size}, {start}+{m}");
                    assert_eq!(bits(&a), bits(&b), "{at}: in place vs gathered");
                    assert_eq!(bits(&a), bits(&c), "{at}: attend");
                }
                // One float slot: no in-place read; the result still follows the values.
                let slot = Slot {
                    page: table[3 / page_size],
                    offset: 3 % page_size,
                };
                let k: Vec<f32> = (0..nkv * hd).map(|c| val(3, c, 0.4) * 3.0).collect();
                let v: Vec<f32> = (0..nkv * hd).map(|c| val(3, c, 1.1)).collect();
                kv.write(0, slot, &k, &v, false);
                assert!(kv.c8_pages(0, &table, n, hd).is_none());
                let q: Vec<f32> = (0..nh * hd).map(|i| (i as f32 * 0.07).sin()).collect();
                let mut got = vec![0f32; nh * hd];
                kv.attend(0, &table, n - 1, &q, 1, nh, hd, &mut got)
                    .unwrap();
                for h in 0..nh {
                    let g = h / (nh / nkv);
                    let qh = &q[h * hd..][..hd];
                    let sc: Vec<f64> = (0..n)
                        .map(|j| {
                            (0..hd)
                                .map(|d| qh[d] as f64 * val(j, g * hd + d, 0.4) as f64 * 3.0)
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hd {
                        let want: f64 = (0..n)
                            .map(|j| e[j] / z * val(j, g * hd + d, 1.1) as f64)
                            .sum();
                        let err = (got[h * hd + d] as f64 - want).abs();
                        assert!(
                            err < 0.03,
                            "{scale:?} h{h} d{d}: {} vs {want}",
                            got[h * hd + d]
                        );
                    }
                }
            }
        }
    }
}
