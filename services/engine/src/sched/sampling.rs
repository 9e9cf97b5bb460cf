//! Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded RNG.

use quantmesh_types::SamplingParams;
use rand::rngs::StdRng;
use rand::Rng;

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
}
