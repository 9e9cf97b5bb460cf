//! Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded RNG.

use quantmesh_types::{SamplingParams, TokenLogprobs};
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::HashMap;

/// Index of the largest logit, NaNs left out (lowest index wins ties; 0 when every logit
/// is NaN). Greedy decoding runs it once per token over the whole vocabulary, so it is two
/// passes the compiler vectorizes: the maximum in lanes (a comparison with NaN is false, so
/// a NaN never wins), then the first chunk holding it.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            if x > *m {
                *m = x;
            }
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &x in lanes.iter().chain(tail) {
        if x > max {
            max = x;
        }
    }
    let chunk = logits
        .chunks(LANES)
        .position(|c| c.iter().fold(false, |hit, &x| hit | (x == max)))
        .unwrap_or(0);
    let at = logits[chunk * LANES..]
        .iter()
        .position(|&x| x == max)
        .unwrap_or(0);
    (chunk * LANES + at) as u32
}

/// Apply `logit_bias`, the OpenAI presence/frequency penalties (over the generated tokens)
/// and the repetition penalty (over prompt and generated tokens) to `logits`, in place.
pub fn adjust_logits(logits: &mut [f32], p: &SamplingParams, prompt: &[u32], output: &[u32]) {
    let n = logits.len();
    for &(t, b) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }
    if p.repetition_penalty != 1.0 {
        let mut seen = vec![false; n];
        for &t in prompt.iter().chain(output) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (l, _) in logits.iter_mut().zip(&seen).filter(|(_, s)| **s) {
            *l = if *l > 0.0 {
                *l / p.repetition_penalty
            } else {
                *l * p.repetition_penalty
            };
        }
    }
}

/// The log-probability of `token` and the `top` most likely tokens under the softmax of
/// `logits` (the model's own distribution).
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = max
        + logits
            .iter()
            .filter(|x| x.is_finite())
            .map(|&x| ((x - max) as f64).exp())
            .sum::<f64>()
            .ln() as f32;
    let lp = |t: usize| logits.get(t).map_or(f32::NEG_INFINITY, |&x| x - lse);
    let mut best: Vec<usize> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &x) in logits.iter().enumerate() {
            if !x.is_finite() {
                continue;
            }
            if best.len() < top || x > logits[best[best.len() - 1]] {
                let at = best.partition_point(|&b| logits[b] >= x);
                best.insert(at, i);
                best.truncate(top);
            }
        }
    }
    TokenLogprobs {
        logprob: lp(token as usize),
        top: best.into_iter().map(|i| (i as u32, lp(i))).collect(),
    }
}

/// Draw a token from `softmax(logits / temperature)` restricted to the `top_k` largest
/// logits and then to the smallest most-likely set whose probability reaches `top_p`.
///
/// No full-vocabulary sort: `top_k` is a selection (linear time), and the nucleus is sorted
/// only as far as it reaches (chunks of 64, 256, … taken by selection from what is left), so
/// the cost per token is a few passes over the vocabulary, whatever the batch. Ties between
/// equal logits go to the lower index, as in [`argmax`].
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut StdRng) -> u32 {
    if p.temperature <= 0.0 || p.top_k == 1 || !(1.0 / p.temperature).is_finite() {
        return argmax(logits);
    }
    if p.top_p >= 1.0 && (p.top_k == 0 || p.top_k >= logits.len()) {
        return sample_all(logits, 1.0 / p.temperature, rng);
    }
    let mut idx: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    if idx.is_empty() {
        return argmax(logits);
    }
    // Descending logit, then ascending index: a total order on the candidates.
    let order = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    if p.top_k > 0 && p.top_k < idx.len() {
        idx.select_nth_unstable_by(p.top_k - 1, order);
        idx.truncate(p.top_k);
    }
    let max = idx
        .iter()
        .map(|&i| logits[i])
        .fold(f32::NEG_INFINITY, f32::max);
    // (token, unnormalized probability), each exponential computed once.
    let mut cand: Vec<(usize, f32)> = idx
        .into_iter()
        .map(|i| (i, ((logits[i] - max) / p.temperature).exp()))
        .collect();
    if p.top_p < 1.0 {
        let order = |a: &(usize, f32), b: &(usize, f32)| order(&a.0, &b.0);
        let total: f32 = cand.iter().map(|c| c.1).sum();
        let (mut acc, mut sorted, mut chunk) = (0f32, 0usize, 64usize);
        let mut keep = cand.len();
        'nucleus: while sorted < cand.len() {
            let end = (sorted + chunk).min(cand.len());
            if end < cand.len() {
                cand[sorted..].select_nth_unstable_by(end - sorted - 1, order);
            }
            cand[sorted..end].sort_unstable_by(order);
            for (n, c) in cand[sorted..end].iter().enumerate() {
                acc += c.1 / total;
                if acc >= p.top_p {
                    keep = sorted + n + 1;
                    break 'nucleus;
                }
            }
            sorted = end;
            chunk *= 4;
        }
        cand.truncate(keep);
    }
    let total: f32 = cand.iter().map(|c| c.1).sum();
    let mut r = rng.gen::<f32>() * total;
    for &(i, q) in &cand {
        if r < q {
            return i as u32;
        }
        r -= q;
    }
    cand[cand.len() - 1].0 as u32
}

/// [`sample`] over the whole vocabulary (no top-k, no nucleus): the softmax weights in one
/// vectorized pass into a per-thread buffer, then one draw by the cumulative sum. No index
/// list and no sort, so a row costs two passes over its logits whatever the batch.
fn sample_all(logits: &[f32], inv_t: f32, rng: &mut StdRng) -> u32 {
    thread_local! {
        static WEIGHTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    WEIGHTS.with(|w| {
        // Every weight is written below: only the length is set (no zeroing per row).
        let mut w = w.borrow_mut();
        w.resize(logits.len(), 0.0);
        let isa = quantmesh_kernels::Isa::current();
        let total = match quantmesh_kernels::softmax_weights(logits, inv_t, &mut w, isa) {
            Ok(Some(total)) if total > 0.0 => total,
            _ => return argmax(logits),
        };
        let mut r = rng.gen::<f32>() * total;
        let mut last = 0;
        for (i, &q) in w.iter().enumerate() {
            if q > 0.0 {
                if r < q {
                    return i as u32;
                }
                r -= q;
                last = i;
            }
        }
        // Rounding left `r` past the last weight: the last candidate, as in `sample`.
        last as u32
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// The vectorized argmax picks what one scalar scan picks (the first non-NaN maximum),
    /// with ties, NaNs and infinities anywhere, at lengths around its lane width.
    #[test]
    fn argmax_is_the_first_largest_logit_without_nans() {
        fn scan(logits: &[f32]) -> u32 {
            let mut best = 0usize;
            for (i, &x) in logits.iter().enumerate() {
                if x > logits[best] || (logits[best].is_nan() && !x.is_nan()) {
                    best = i;
                }
            }
            best as u32
        }
        let mut rng = StdRng::seed_from_u64(3);
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 2.0];
        for len in [0usize, 1, 2, 15, 16, 17, 33, 100, 49_152] {
            for trial in 0..40 {
                let mut v: Vec<f32> = (0..len).map(|_| rng.gen_range(-3.0f32..2.0)).collect();
                for _ in 0..trial % 5 {
                    if len > 0 {
                        let at = rng.gen_range(0..len);
                        v[at] = specials[rng.gen_range(0..specials.len())];
                    }
                }
                if trial % 7 == 0 {
                    v.iter_mut().for_each(|x| *x = f32::NAN);
                }
                if trial % 11 == 0 {
                    v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
                }
                assert_eq!(argmax(&v), scan(&v), "len {len}, trial {trial}: {v:?}");
            }
        }
    }

    #[test]
    fn greedy_and_seeded_sampling_are_deterministic() {
        let logits = vec![0.1, 2.0, 1.9, -1.0];
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        assert_eq!(sample(&logits, &greedy, &mut StdRng::seed_from_u64(0)), 1);
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut r = StdRng::seed_from_u64(7);
            (0..20).map(|_| sample(&logits, &p, &mut r)).collect()
        };
        let b: Vec<u32> = {
            let mut r = StdRng::seed_from_u64(7);
            (0..20).map(|_| sample(&logits, &p, &mut r)).collect()
        };
        assert_eq!(a, b);
        let top1 = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 0.01,
            ..Default::default()
        };
        let mut r = StdRng::seed_from_u64(1);
        assert!((0..50).all(|_| sample(&logits, &top1, &mut r) == 1));
    }

    /// Over a 49 152-token vocabulary (the nucleus runs past the first sorted chunks): the
    /// draws follow the softmax, top-k keeps exactly the k largest, and top-p keeps exactly
    /// the smallest most-likely set reaching p (compared with a full sort).
    #[test]
    fn sampling_follows_the_softmax_and_its_truncations_on_a_large_vocabulary() {
        let n = 49_152;
        let logits: Vec<f32> = (0..n)
            .map(|i| ((i as u64 * 2_654_435_761) % 1000) as f32 / 120.0)
            .collect();
        let temp = 0.8;
        let mut sorted: Vec<usize> = (0..n).collect();
        sorted.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let w: Vec<f64> = (0..n)
            .map(|i| ((logits[i] - logits[sorted[0]]) as f64 / temp as f64).exp())
            .collect();
        let z: f64 = w.iter().sum();
        // top_p: the reference nucleus from the full sort
        let top_p = 0.5;
        let mut acc = 0.0;
        let nucleus = sorted
            .iter()
            .position(|&i| {
                acc += w[i] / z;
                acc >= top_p as f64
            })
            .map_or(n, |k| k + 1);
        assert!(
            nucleus > 64 * 5,
            "the nucleus spans several chunks ({nucleus})"
        );
        let allowed: std::collections::HashSet<usize> = sorted[..nucleus].iter().copied().collect();
        let boundary = logits[sorted[nucleus - 1]];
        let params = |top_k, top_p| SamplingParams {
            temperature: temp,
            top_k,
            top_p,
            ..Default::default()
        };
        let mut rng = StdRng::seed_from_u64(3);
        let mut counts = vec![0u32; n];
        for _ in 0..1000 {
            let t = sample(&logits, &params(0, top_p), &mut rng) as usize;
            // the same logit as a kept token at the boundary is the only ambiguity
            assert!(
                allowed.contains(&t) || logits[t] == boundary,
                "token {t} outside the nucleus"
            );
            counts[t] += 1;
        }
        // and it is not cut short: its last quarter is drawn too
        let tail: u32 = sorted[nucleus * 3 / 4..nucleus]
            .iter()
            .map(|&i| counts[i])
            .sum();
        assert!(tail > 0, "no draw in the nucleus's last quarter");
        // top_k: only the k largest
        let top_k = 100;
        let k_set: std::collections::HashSet<usize> = sorted[..top_k].iter().copied().collect();
        for _ in 0..200 {
            let t = sample(&logits, &params(top_k, 1.0), &mut rng) as usize;
            assert!(k_set.contains(&t), "token {t} outside the top {top_k}");
        }
        // no truncation: the frequency of each logit level follows the softmax (on the
        // first 2048 tokens, enough draws to count)
        let (n, draws) = (2048, 20_000);
        let logits = &logits[..n];
        let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = logits
            .iter()
            .map(|&l| ((l - mx) as f64 / temp as f64).exp())
            .collect();
        let z: f64 = w.iter().sum();
        let mut level = std::collections::BTreeMap::<u32, (f64, u32)>::new();
        let mut full = vec![0u32; n];
        for _ in 0..draws {
            full[sample(logits, &params(0, 1.0), &mut rng) as usize] += 1;
        }
        for i in 0..n {
            let e = level.entry((logits[i] * 120.0).round() as u32).or_default();
            e.0 += w[i] / z;
            e.1 += full[i];
        }
        for (&l, &(prob, seen)) in level.iter().rev().take(20) {
            let expected = prob * draws as f64;
            let sd = (expected * (1.0 - prob)).sqrt();
            assert!(
                (seen as f64 - expected).abs() < 5.0 * sd + 1.0,
                "logit level {l}: {seen} draws, expected {expected:.1}"
            );
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_is_sorted() {
        let logits = vec![0.0f32, 2.0, 1.0, f32::NEG_INFINITY, 2.0];
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let l = logprobs(&logits, 2, 3);
        assert!((l.logprob as f64 - (1.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = l.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 4, 2], "most likely first, ties by id");
        let total: f64 = logits.iter().map(|&x| ((x as f64) - z.ln()).exp()).sum();
        assert!((total - 1.0).abs() < 1e-9);
        assert!(logprobs(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn penalties_and_bias_follow_their_definitions() {
        let base = vec![1.0f32, 2.0, -1.0, 0.5];
        let adjusted = |p: SamplingParams, prompt: &[u32], output: &[u32]| {
            let mut l = base.clone();
            adjust_logits(&mut l, &p, prompt, output);
            l
        };
        // presence: once per distinct generated token; frequency: per occurrence.
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        assert_eq!(adjusted(p, &[3], &[1, 1, 2]), vec![1.0, 1.0, -1.75, 0.5]);
        // repetition: prompt and output, divides positive logits, multiplies negative ones.
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        assert_eq!(adjusted(p, &[0], &[2]), vec![0.5, 2.0, -2.0, 0.5]);
        // bias: added; out-of-vocabulary ids are ignored (the engine rejects them first).
        let p = SamplingParams {
            logit_bias: vec![(3, 100.0), (9, 1.0)],
            temperature: 0.0,
            ..Default::default()
        };
        let l = adjusted(p.clone(), &[], &[]);
        assert_eq!(l, vec![1.0, 2.0, -1.0, 100.5]);
        assert_eq!(sample(&l, &p, &mut StdRng::seed_from_u64(0)), 3);
    }
}
