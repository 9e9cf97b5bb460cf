//! Activation probes: one pass over a group's input rows (no tensor ops) that yields the
//! monitor's statistic per row, the rows above the per-token bound, each row's massive
//! channels while they are being learned, each row's harm (the output noise-to-signal ratio
//! of the group's quantized weights on it), and whether a NaN/Inf was seen.

use crate::backend::ColumnError;
use crate::error::Result;
use crate::kv::SeqId;
use crate::precision::mask::GroupDetector;
use candle_core::Tensor;
use quantmesh_kernels::{abs_max, probe_row, Isa, Pool, RowProbe};
use quantmesh_model::massive::massive_in_row;
use quantmesh_types::GroupId;

/// Rows from which a group's rows are measured on the kernel pool (a prefill chunk); fewer
/// stay on the calling thread, where waking the pool would cost more than it saves.
const POOL_ROWS: usize = 32;

/// One group's statistics for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupObs {
    pub group: GroupId,
    /// Per row: abs-max of the input over non-excluded channels; NaN for skipped positions.
    pub stats: Vec<f32>,
    /// Rows routed to float in this group by the per-token bound.
    pub token_float_rows: Vec<usize>,
    /// Per row: channels massive in that row (only while learning massive channels; empty
    /// for skipped positions).
    pub massive: Vec<Vec<u32>>,
    /// Per row: the output noise-to-signal ratio the group's quantized weights give this
    /// input ([`crate::backend::ColumnError::nsr`]); empty when the group has no quantized
    /// form, NaN for skipped positions.
    pub harm: Vec<f32>,
}

/// Measure one group's input rows: returns the observation and whether a non-finite value
/// was seen. A single pass over the data, no tensor ops.
pub fn observe_rows(
    g: GroupId,
    det: &GroupDetector,
    input: &Tensor,
    rows: &[(SeqId, usize)],
    skip: &[usize],
) -> Result<(GroupObs, bool)> {
    let (n, d) = input.dims2()?;
    // Read the activations in place when they are contiguous f32 on the CPU (the usual
    // case); copy otherwise.
    let (storage, layout) = input.storage_and_layout();
    let borrowed = match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(cpu), Some((start, end))) => {
            cpu.as_slice::<f32>().ok().map(|s| &s[start..end])
        }
        _ => None,
    };
    let owned;
    let data: &[f32] = match borrowed {
        Some(d) => d,
        None => {
            owned = input.flatten_all()?.to_vec1::<f32>()?;
            &owned
        }
    };
    // Channel ranges that count (everything but the excluded channels).
    let mut ranges = Vec::with_capacity(det.excluded_channels.len() + 1);
    let mut from = 0;
    for &c in det.excluded_channels.iter().filter(|&&c| c < d) {
        if c > from {
            ranges.push(from..c);
        }
        from = c + 1;
    }
    if from < d {
        ranges.push(from..d);
    }
    let whole_row = ranges.len() == 1 && ranges[0] == (0..d);
    let isa = Isa::current();
    let mut obs = GroupObs {
        group: g,
        stats: Vec::with_capacity(n),
        token_float_rows: Vec::new(),
        massive: Vec::new(),
        harm: Vec::new(),
    };
    // One vectorized pass per row (`probe_row`: the row's sum — a NaN or Inf anywhere makes
    // it non-finite —, its largest magnitude and the harm ratio's sums), plus the largest
    // magnitude outside the excluded channels when there are any. A prefill chunk's rows are
    // spread over the kernel pool; a decode step's few rows stay on this thread.
    let columns = det.column_error.as_deref().map(ColumnError::columns);
    let measure = |slot: &mut (usize, Option<(RowProbe, f32)>)| {
        let r = slot.0;
        if skip.contains(&rows[r].1) {
            return;
        }
        let row = &data[r * d..(r + 1) * d];
        let p = probe_row(row, columns, isa);
        let m = if whole_row {
            p.abs_max
        } else {
            ranges
                .iter()
                .map(|rg| abs_max(&row[rg.clone()], isa))
                .fold(0f32, f32::max)
        };
        slot.1 = Some((p, m));
    };
    let mut measured: Vec<(usize, Option<(RowProbe, f32)>)> = (0..n).map(|r| (r, None)).collect();
    if n >= POOL_ROWS {
        Pool::global().for_each_mut(&mut measured, measure);
    } else {
        measured.iter_mut().for_each(measure);
    }
    let mut scratch = Vec::new();
    let mut non_finite = false;
    for (r, m) in measured {
        let row = &data[r * d..(r + 1) * d];
        let Some((p, m)) = m else {
            obs.stats.push(f32::NAN);
            if det.learn_channels {
                obs.massive.push(Vec::new());
            }
            if det.column_error.is_some() {
                obs.harm.push(f32::NAN);
            }
            continue;
        };
        let finite = p.sum.is_finite();
        non_finite |= !finite;
        if det.learn_channels {
            let mut found = Vec::new();
            massive_in_row(row, det.massive_ratio, &mut scratch, &mut found);
            obs.massive.push(found);
        }
        if det.column_error.is_some() {
            obs.harm.push(p.nsr());
        }
        if m > det.token_bound {
            obs.token_float_rows.push(r);
        }
        obs.stats.push(if finite { m } else { f32::INFINITY });
    }
    Ok((obs, non_finite))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use quantmesh_types::GroupKind;
    use std::sync::Arc;

    /// Per row: the largest magnitude outside the excluded channels (a massive channel
    /// does not count), the harm ratio of the group's column errors, a row routed to float
    /// above the per-token bound, a skipped position left out, and a NaN reported.
    #[test]
    fn rows_are_measured_outside_the_excluded_channels() {
        let d = 40;
        let columns = Arc::new(ColumnError {
            error: (0..d).map(|j| 1e-3 * (j % 5) as f32).collect(),
            energy: (0..d).map(|j| 1.0 + j as f32).collect(),
        });
        let mut data: Vec<f32> = (0..4 * d).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        data[3] = 900.0; // row 0, the excluded massive channel
        data[d + 17] = -30.0; // row 1: above the per-token bound
        data[3 * d + 21] = f32::NAN; // row 3
        let input = Tensor::from_vec(data.clone(), (4, d), &candle_core::Device::Cpu).unwrap();
        let rows = [(1, 0), (1, 1), (2, 0), (2, 1)];
        let g = GroupId::new(0, GroupKind::Qkv);
        for isa in Isa::all_available() {
            for excluded in [vec![3], vec![]] {
                let det = GroupDetector {
                    excluded_channels: excluded.clone(),
                    token_bound: 20.0,
                    learn_channels: false,
                    massive_ratio: 20.0,
                    column_error: Some(columns.clone()),
                };
                let (obs, bad) = isa
                    .scoped(|| observe_rows(g, &det, &input, &rows, &[5]))
                    .unwrap();
                assert!(bad, "{isa:?}: the NaN is reported");
                let expect = |r: usize| {
                    (0..d)
                        .filter(|j| !excluded.contains(j))
                        .map(|j| data[r * d + j].abs())
                        .fold(0f32, f32::max)
                };
                assert_eq!(obs.stats[0], expect(0), "{isa:?} {excluded:?}");
                assert_eq!(obs.stats[1], 30.0);
                assert_eq!(obs.stats[2], expect(2));
                assert_eq!(obs.stats[3], f32::INFINITY);
                let massive = if excluded.is_empty() {
                    vec![0, 1]
                } else {
                    vec![1]
                };
                assert_eq!(obs.token_float_rows, massive, "{isa:?} {excluded:?}");
                for r in 0..3 {
                    let row = &data[r * d..(r + 1) * d];
                    assert_eq!(obs.harm[r], columns.nsr(row));
                    assert!(obs.harm[r] > 0.0);
                }
                assert_eq!(obs.harm.len(), 4);
            }
        }
        // A prefill chunk's rows, measured on the pool, give what each row gives alone.
        let many = 10 * 4;
        let long: Vec<f32> = (0..many)
            .flat_map(|r| data[(r % 4) * d..(r % 4 + 1) * d].to_vec())
            .collect();
        let long = Tensor::from_vec(long, (many, d), &candle_core::Device::Cpu).unwrap();
        let long_rows: Vec<(u64, usize)> = (0..many).map(|r| rows[r % 4]).collect();
        assert!(many >= POOL_ROWS);
        let det = GroupDetector {
            excluded_channels: vec![3],
            token_bound: 20.0,
            column_error: Some(columns.clone()),
            ..Default::default()
        };
        let (few, _) = observe_rows(g, &det, &input, &rows, &[0]).unwrap();
        let (all, bad) = observe_rows(g, &det, &long, &long_rows, &[0]).unwrap();
        assert!(bad, "the NaN of a row measured on the pool is reported");
        assert_eq!(few.token_float_rows, vec![1]);
        for r in 0..many {
            assert_eq!(
                all.stats[r].to_bits(),
                few.stats[r % 4].to_bits(),
                "row {r}"
            );
            assert_eq!(all.harm[r].to_bits(), few.harm[r % 4].to_bits(), "row {r}");
        }
        let routed: Vec<usize> = (0..many)
            .filter(|r| few.token_float_rows.contains(&(r % 4)))
            .collect();
        assert_eq!(all.token_float_rows, routed);
        // A skipped position: no statistic, no harm.
        let det = GroupDetector {
            token_bound: f32::INFINITY,
            column_error: Some(columns),
            ..Default::default()
        };
        let (obs, _) = observe_rows(g, &det, &input, &rows, &[1]).unwrap();
        assert!(obs.stats[1].is_nan() && obs.stats[3].is_nan());
        assert!(obs.harm[1].is_nan() && obs.harm[3].is_nan());
    }
}
