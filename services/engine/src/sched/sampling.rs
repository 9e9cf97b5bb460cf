//! Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded RNG.

use quantmesh_types::{SamplingParams, TokenLogprobs};
use rand::rngs::StdRng;
use rand::Rng;
use std::collections::HashMap;

/// Index of the largest finite logit (lowest index wins ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] || (logits[best].is_nan() && !x.is_nan()) {
            best = i;
        }
    }
    best as u32
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

pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut StdRng) -> u32 {
    if p.temperature <= 0.0 || p.top_k == 1 {
        return argmax(logits);
    }
    let mut idx: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    if idx.is_empty() {
        return argmax(logits);
    }
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if p.top_k > 0 {
        idx.truncate(p.top_k);
    }
    let max = logits[idx[0]];
    let mut probs: Vec<f32> = idx
        .iter()
        .map(|&i| ((logits[i] - max) / p.temperature).exp())
        .collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= sum);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (n, q) in probs.iter().enumerate() {
            acc += q;
            if acc >= p.top_p {
                keep = n + 1;
                break;
            }
        }
        probs.truncate(keep);
        idx.truncate(keep);
    }
    let total: f32 = probs.iter().sum();
    let mut r = rng.gen::<f32>() * total;
    for (q, &i) in probs.iter().zip(&idx) {
        if r < *q {
            return i as u32;
        }
        r -= q;
    }
    idx[idx.len() - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

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
