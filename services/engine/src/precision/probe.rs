//! Activation probes: one pass over a group's input rows (no tensor ops) that yields the
//! monitor's statistic per row, the rows above the per-token bound, each row's massive
//! channels while they are being learned, each row's harm (the output noise-to-signal ratio
//! of the group's quantized weights on it), and whether a NaN/Inf was seen.

use crate::error::Result;
use crate::kv::SeqId;
use crate::precision::mask::GroupDetector;
use candle_core::Tensor;
use quantmesh_model::massive::massive_in_row;
use quantmesh_types::GroupId;

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
    let mut obs = GroupObs {
        group: g,
        stats: Vec::with_capacity(n),
        token_float_rows: Vec::new(),
        massive: Vec::new(),
        harm: Vec::new(),
    };
    let mut scratch = Vec::new();
    let mut non_finite = false;
    for r in 0..n {
        let row = &data[r * d..(r + 1) * d];
        if skip.contains(&rows[r].1) {
            obs.stats.push(f32::NAN);
            if det.learn_channels {
                obs.massive.push(Vec::new());
            }
            if det.column_error.is_some() {
                obs.harm.push(f32::NAN);
            }
            continue;
        }
        // A NaN or Inf anywhere makes the row sum non-finite: one cheap check per row.
        let finite = sum8(row).is_finite();
        non_finite |= !finite;
        let m = ranges
            .iter()
            .map(|rg| absmax8(&row[rg.clone()]))
            .fold(0f32, f32::max);
        if det.learn_channels {
            let mut found = Vec::new();
            massive_in_row(row, det.massive_ratio, &mut scratch, &mut found);
            obs.massive.push(found);
        }
        if let Some(ce) = &det.column_error {
            obs.harm.push(ce.nsr(row));
        }
        if m > det.token_bound {
            obs.token_float_rows.push(r);
        }
        obs.stats.push(if finite { m } else { f32::INFINITY });
    }
    Ok((obs, non_finite))
}

/// Abs-max with 8 independent lanes (vectorizes to max instructions).
#[inline]
fn absmax8(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    for c in chunks {
        for k in 0..8 {
            let a = c[k].abs();
            lanes[k] = if a > lanes[k] { a } else { lanes[k] };
        }
    }
    lanes.iter().fold(tail, |m, &v| if v > m { v } else { m })
}

/// Sum with 8 independent lanes.
#[inline]
fn sum8(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for k in 0..8 {
            lanes[k] += c[k];
        }
    }
    lanes.iter().sum::<f32>() + tail
}
