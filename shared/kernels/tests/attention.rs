//! Attention against a plain f64 softmax, every instruction set giving the same bits.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use quantmesh_kernels::{
    attention, attention_over, exp_nonpositive, AttentionShape, Contiguous, Isa, KvElem, KvRun,
    KvSource, Pool,
};
use rand::{Rng, SeedableRng};

fn reference(q: &[f32], k: &[f32], v: &[f32], s: AttentionShape) -> Vec<f64> {
    let hd = s.head_dim;
    let keys = k.len() / (s.kv_heads * hd);
    let mut out = vec![0f64; q.len()];
    for i in 0..s.rows {
        for h in 0..s.heads {
            let g = h / (s.heads / s.kv_heads);
            let ctx = s.start + i + 1;
            let qh = &q[(i * s.heads + h) * hd..][..hd];
            let sc: Vec<f64> = (0..ctx)
                .map(|j| {
                    let kj = &k[(g * keys + j) * hd..][..hd];
                    qh.iter()
                        .zip(kj)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                out[(i * s.heads + h) * hd + d] = (0..ctx)
                    .map(|j| e[j] * v[(g * keys + j) * hd + d] as f64)
                    .sum::<f64>()
                    / z;
            }
        }
    }
    out
}

fn check(s: AttentionShape, extra_keys: usize, seed: u64, threads: usize) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let keys = s.start + s.rows + extra_keys;
    let mut r = |n: usize, a: f32| (0..n).map(|_| rng.gen_range(-a..a)).collect::<Vec<f32>>();
    let q = r(s.rows * s.heads * s.head_dim, 3.0);
    let k = r(s.kv_heads * keys * s.head_dim, 3.0);
    let v = r(s.kv_heads * keys * s.head_dim, 1.0);
    let want = reference(&q, &k, &v, s);
    let pool = Pool::new(threads);
    let mut first: Option<Vec<f32>> = None;
    for isa in Isa::all_available() {
        let mut out = vec![f32::NAN; q.len()];
        attention(&q, &k, &v, s, &mut out, isa, &pool).unwrap();
        for (i, (g, w)) in out.iter().zip(&want).enumerate() {
            assert!(
                (*g as f64 - w).abs() < 1e-5,
                "{isa:?} {s:?} out {i}: {g} vs {w}"
            );
        }
        match &first {
            None => first = Some(out),
            Some(f) => assert_eq!(f, &out, "{isa:?} differs from the scalar build"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn equals_the_reference(
        rows in 1usize..9, start in 0usize..40, kv_heads in 1usize..4, rep in 1usize..8,
        head_dim in 1usize..70, extra in 0usize..5, seed in 0u64..1000, threads in 1usize..4,
    ) {
        let s = AttentionShape { rows, start, heads: kv_heads * rep, kv_heads, head_dim };
        check(s, extra, seed, threads);
    }
}

#[test]
fn model_shapes() {
    // SmolLM2: 9 heads over 3, width 64; a prefill chunk and a decode step.
    let s = AttentionShape {
        rows: 40,
        start: 0,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    check(s, 0, 1, 2);
    let s = AttentionShape {
        rows: 1,
        start: 300,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    check(s, 7, 2, 2);
    // Width 128 (Llama-style heads; its own SIMD form), grouped 4 to 1.
    let s = AttentionShape {
        rows: 9,
        start: 20,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
    };
    check(s, 3, 3, 2);
}

/// Query heads that share a key/value head are computed together, in groups whose size
/// follows the pool's threads (one decode row on many threads: groups of one head; on one
/// thread: groups of four). A head's bits must not depend on its group, so every thread
/// count gives the same output, for every instruction set and both common widths.
#[test]
fn a_heads_bits_do_not_depend_on_its_group() {
    for (head_dim, kv_heads, rep, rows) in
        [(64, 1, 7, 1), (128, 2, 5, 1), (64, 3, 3, 2), (40, 1, 6, 1)]
    {
        let s = AttentionShape {
            rows,
            start: 300,
            heads: kv_heads * rep,
            kv_heads,
            head_dim,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(head_dim as u64 + rep as u64);
        let keys = s.start + s.rows;
        let mut r = |n: usize| {
            (0..n)
                .map(|_| rng.gen_range(-2.0f32..2.0))
                .collect::<Vec<f32>>()
        };
        let q = r(s.rows * s.heads * head_dim);
        let k = r(kv_heads * keys * head_dim);
        let v = r(kv_heads * keys * head_dim);
        let mut first: Option<Vec<f32>> = None;
        for threads in [1, 2, 3, 4, 8] {
            let pool = Pool::new(threads);
            for isa in Isa::all_available() {
                let mut out = vec![f32::NAN; q.len()];
                attention(&q, &k, &v, s, &mut out, isa, &pool).unwrap();
                match &first {
                    None => first = Some(out),
                    Some(f) => assert_eq!(f, &out, "{s:?} on {threads} threads with {isa:?}"),
                }
            }
        }
    }
}

/// 8-bit keys and values in pages of `page` rows, `[page][row][kv_heads · head_dim]` as a
/// paged cache lays them out, one scale per (row, head): each page is one run.
struct Paged {
    k: Vec<Vec<i8>>,
    v: Vec<Vec<i8>>,
    ks: Vec<Vec<f32>>,
    vs: Vec<Vec<f32>>,
    page: usize,
    keys: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl KvSource for Paged {
    type Elem = i8;
    fn keys(&self) -> usize {
        self.keys
    }
    fn runs<F: FnMut(KvRun<'_, i8>)>(&self, values: bool, g: usize, n: usize, mut f: F) {
        let (data, scales) = if values {
            (&self.v, &self.vs)
        } else {
            (&self.k, &self.ks)
        };
        let mut left = n;
        for (d, s) in data.iter().zip(scales) {
            if left == 0 {
                break;
            }
            let rows = left.min(self.page);
            f(KvRun {
                rows,
                data: &d[g * self.head_dim..],
                stride: self.kv_heads * self.head_dim,
                scales: &s[g..],
                scale_stride: self.kv_heads,
            });
            left -= rows;
        }
    }
}

/// Keys and values as 8-bit integers with a scale per row: read from pages of any size,
/// or from one contiguous 8-bit buffer, they give the same bits as the same integers
/// handed over as f32 with the same scales, on every instruction set, and stay within the
/// f64 reference on the dequantized values.
fn check_8bit(s: AttentionShape, page: usize, seed: u64, threads: usize) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (hd, nkv, keys) = (s.head_dim, s.kv_heads, s.start + s.rows);
    let q: Vec<f32> = (0..s.rows * s.heads * hd)
        .map(|_| rng.gen_range(-3.0..3.0))
        .collect();
    let mut ints = |n: usize| {
        (0..n)
            .map(|_| rng.gen_range(-127..=127i8))
            .collect::<Vec<_>>()
    };
    let (k8, v8) = (ints(nkv * keys * hd), ints(nkv * keys * hd));
    let mut scales = |n: usize| {
        (0..n)
            .map(|_| rng.gen_range(0.001..0.05f32))
            .collect::<Vec<_>>()
    };
    let (ks, vs) = (scales(nkv * keys), scales(nkv * keys));
    let deq = |x: &[i8], sc: &[f32]| -> Vec<f32> {
        x.iter()
            .enumerate()
            .map(|(i, &x)| x as f32 * sc[i / hd])
            .collect()
    };
    let want = reference(&q, &deq(&k8, &ks), &deq(&v8, &vs), s);
    // [page][row][kv head][hd] from [kv head][key][hd]
    let pages = keys.div_ceil(page);
    let mut paged = Paged {
        k: vec![vec![0; page * nkv * hd]; pages],
        v: vec![vec![0; page * nkv * hd]; pages],
        ks: vec![vec![0.0; page * nkv]; pages],
        vs: vec![vec![0.0; page * nkv]; pages],
        page,
        keys,
        kv_heads: nkv,
        head_dim: hd,
    };
    for g in 0..nkv {
        for j in 0..keys {
            let (p, r) = (j / page, j % page);
            let (src, dst) = ((g * keys + j) * hd, (r * nkv + g) * hd);
            paged.k[p][dst..dst + hd].copy_from_slice(&k8[src..src + hd]);
            paged.v[p][dst..dst + hd].copy_from_slice(&v8[src..src + hd]);
            paged.ks[p][r * nkv + g] = ks[g * keys + j];
            paged.vs[p][r * nkv + g] = vs[g * keys + j];
        }
    }
    let as_f32 = |x: &[i8]| x.iter().map(|&x| x.to_f32()).collect::<Vec<f32>>();
    let (kf, vf) = (as_f32(&k8), as_f32(&v8));
    fn contiguous<'a, E>(
        k: &'a [E],
        v: &'a [E],
        scales: (&'a [f32], &'a [f32]),
        keys: usize,
        head_dim: usize,
    ) -> Contiguous<'a, E> {
        Contiguous {
            k,
            v,
            k_scales: Some(scales.0),
            v_scales: Some(scales.1),
            keys,
            head_dim,
        }
    }
    let sc = (&ks[..], &vs[..]);
    let pool = Pool::new(threads);
    let mut first: Option<Vec<f32>> = None;
    for isa in Isa::all_available() {
        let mut outs = Vec::new();
        for which in 0..3 {
            let mut out = vec![f32::NAN; q.len()];
            match which {
                0 => attention_over(
                    &q,
                    &contiguous(&kf, &vf, sc, keys, hd),
                    s,
                    &mut out,
                    isa,
                    &pool,
                ),
                1 => attention_over(
                    &q,
                    &contiguous(&k8, &v8, sc, keys, hd),
                    s,
                    &mut out,
                    isa,
                    &pool,
                ),
                _ => attention_over(&q, &paged, s, &mut out, isa, &pool),
            }
            .unwrap();
            outs.push(out);
        }
        for (i, (g, w)) in outs[0].iter().zip(&want).enumerate() {
            assert!(
                (*g as f64 - w).abs() < 1e-5,
                "{isa:?} {s:?} out {i}: {g} vs {w}"
            );
        }
        let bits = |o: &[f32]| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&outs[0]),
            bits(&outs[1]),
            "{isa:?} {s:?}: 8-bit contiguous"
        );
        assert_eq!(
            bits(&outs[0]),
            bits(&outs[2]),
            "{isa:?} {s:?}: pages of {page}"
        );
        match &first {
            None => first = outs.pop(),
            Some(f) => assert_eq!(
                bits(f),
                bits(&outs[0]),
                "{isa:?} differs from the scalar build"
            ),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(30))]
    #[test]
    fn eight_bit_rows_in_pages_give_the_bits_of_their_integers_as_f32(
        rows in 1usize..6, start in 0usize..40, kv_heads in 1usize..4, rep in 1usize..8,
        wide in 0usize..3, page in 1usize..20, seed in 0u64..1000, threads in 1usize..4,
    ) {
        // widths with their own SIMD form (64, 128) and one without
        let head_dim = [64, 128, 24][wide];
        let s = AttentionShape { rows, start, heads: kv_heads * rep, kv_heads, head_dim };
        check_8bit(s, page, seed, threads);
    }
}

#[test]
fn exp_is_accurate_and_safe() {
    let mut x = 0f32;
    while x >= -87.0 {
        let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
        assert!(
            ((got - want) / want).abs() < 3e-7,
            "exp({x}) = {got}, want {want}"
        );
        x -= 0.0137;
    }
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-100.0), 0.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_nonpositive(f32::NAN), 0.0);
}

#[test]
fn bad_shapes_are_errors() {
    let s = AttentionShape {
        rows: 2,
        start: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
    };
    let mut out = vec![0.0; 16];
    // two keys where row 1 needs three
    assert!(attention(
        &[0.0; 16],
        &[0.0; 8],
        &[0.0; 8],
        s,
        &mut out,
        Isa::Scalar,
        Pool::global()
    )
    .is_err());
    let s = AttentionShape {
        heads: 3,
        kv_heads: 2,
        ..s
    };
    assert!(attention(
        &[0.0; 24],
        &[0.0; 24],
        &[0.0; 24],
        s,
        &mut out,
        Isa::Scalar,
        Pool::global()
    )
    .is_err());
}
