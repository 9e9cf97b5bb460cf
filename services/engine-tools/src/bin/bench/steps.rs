//! Steps driven by hand on a backend: scratch caches, batches admitted, a step for given
//! sequences, the monitor watching served traffic.

use quantmesh_engine::backend::cpu::LlamaModel;
use quantmesh_engine::backend::{SplitActivations, StepInput};
use quantmesh_engine::kv::{BlockManager, KvCache, KvScale};
use quantmesh_engine::precision::{PathMask, StepRunner};
use quantmesh_model::ModelConfig;
use quantmesh_types::Residency;

/// C8 scales of every cache the bench makes (`--kv-scale`; set once at start).
pub(crate) static KV_SCALE: std::sync::OnceLock<KvScale> = std::sync::OnceLock::new();

pub(crate) fn cache(cfg: &ModelConfig, pages: usize, page: usize) -> (KvCache, BlockManager) {
    let scale = KV_SCALE.get().copied().unwrap_or_default();
    quantmesh_engine_tools::scratch_cache_with(cfg, pages, page, scale)
}

/// `b` synthetic prompts of printable tokens, admitted with room for `decode_steps` more.
pub(crate) fn admit_batch(
    bm: &mut BlockManager,
    b: usize,
    prompt_len: usize,
    decode_steps: usize,
) -> Result<Vec<(u64, Vec<u32>)>, String> {
    let prompts: Vec<(u64, Vec<u32>)> = (0..b as u64)
        .map(|i| {
            (
                i,
                (0..prompt_len as u32)
                    .map(|t| 32 + (t * 7 + i as u32) % 90)
                    .collect(),
            )
        })
        .collect();
    for (id, p) in &prompts {
        bm.admit(*id, p, decode_steps).map_err(|e| e.to_string())?;
    }
    Ok(prompts)
}

pub(crate) fn step_for(bm: &mut BlockManager, seqs: &[(u64, Vec<u32>)]) -> StepInput {
    quantmesh_engine_tools::step_for(bm, seqs).expect("reserved")
}

/// A model served step by step on one cache, as the bench drives it.
pub(crate) struct Served<'a> {
    pub(crate) runner: &'a mut StepRunner,
    pub(crate) model: &'a LlamaModel,
    pub(crate) mask: &'a PathMask,
    pub(crate) kv: &'a mut KvCache,
}

impl Served<'_> {
    /// Prefill the admitted `prompts` as the server's scheduler would with `budget` prompt
    /// tokens a step (0: every prompt in one step): first come first served, each step
    /// filled from the first unfinished prompt on, logits only for a prompt's last chunk.
    pub(crate) fn prefill(
        &mut self,
        bm: &mut BlockManager,
        prompts: &[(u64, Vec<u32>)],
        budget: usize,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let budget = if budget == 0 { usize::MAX } else { budget };
        let mut done = vec![0usize; prompts.len()];
        let mut first = 0;
        loop {
            while first < prompts.len() && done[first] == prompts[first].1.len() {
                first += 1;
            }
            if first == prompts.len() {
                return Ok(());
            }
            let (mut seqs, mut last) = (Vec::new(), Vec::new());
            let mut left = budget;
            for ((id, p), d) in prompts.iter().zip(done.iter_mut()).skip(first) {
                if left == 0 {
                    break;
                }
                let n = (p.len() - *d).min(left);
                if n == 0 {
                    continue;
                }
                seqs.push((*id, p[*d..*d + n].to_vec()));
                *d += n;
                left -= n;
                last.push(*d == p.len());
            }
            let mut step = step_for(bm, &seqs);
            for (chunk, last) in step.chunks.iter_mut().zip(last) {
                chunk.want_logits = last;
            }
            self.runner
                .run(self.model, &step, self.mask, self.kv, true)?;
        }
    }
}

/// Run the activation monitor over `requests` (each its own sequence, `rounds` times) as
/// served traffic, set up as the engine sets up its own: each group with the residency the
/// model serves it in, activation spikes counted; returns it and the mask it publishes.
pub(crate) fn watch(
    model: &LlamaModel,
    cfg: &ModelConfig,
    mcfg: quantmesh_engine::monitor::MonitorConfig,
    requests: &[Vec<u32>],
    rounds: u64,
) -> Result<(quantmesh_engine::monitor::Monitor, PathMask), Box<dyn std::error::Error>> {
    watch_with(
        model,
        cfg,
        mcfg,
        requests,
        rounds,
        true,
        SplitActivations::All,
    )
}

/// As [`watch`]; `spikes`: whether activation spikes count as outliers (the engine counts
/// them under every activation width; off reproduces its earlier rule for `all`);
/// `width`: the activation width served (under `copyless` and `copyless_q4` rows wanting
/// float in a group without a float copy are served with 16-bit activations, as the
/// engine does).
pub(crate) fn watch_with(
    model: &LlamaModel,
    cfg: &ModelConfig,
    mcfg: quantmesh_engine::monitor::MonitorConfig,
    requests: &[Vec<u32>],
    rounds: u64,
    spikes: bool,
    width: SplitActivations,
) -> Result<(quantmesh_engine::monitor::Monitor, PathMask), Box<dyn std::error::Error>> {
    use quantmesh_engine::backend::Backend;
    use quantmesh_types::{GroupId, GroupKind};
    let residencies: Vec<(GroupId, Residency)> = (0..cfg.num_hidden_layers)
        .flat_map(|l| GroupKind::ALL.map(|k| GroupId::new(l, k)))
        .map(|g| (g, model.residency(g)))
        .collect();
    let mut monitor = quantmesh_engine::monitor::Monitor::new(mcfg, "bench", &residencies);
    monitor.set_activation_spikes(spikes);
    monitor.set_width(width);
    // The harm test's column errors, as the engine gives them.
    monitor.set_column_errors(
        residencies
            .iter()
            .map(|(g, _)| (*g, model.column_error(*g))),
    );
    let mut runner = StepRunner::default();
    let page = 16;
    for round in 0..rounds {
        for (i, ids) in requests.iter().enumerate() {
            let mut mask = PathMask::default();
            monitor.apply_to(&mut mask);
            let pages = ids.len().div_ceil(page) + 1;
            let (mut kv, mut bm) = cache(cfg, pages, page);
            let id = round * 1_000_000 + i as u64;
            bm.admit(id, &[], ids.len()).map_err(|e| e.to_string())?;
            let step = step_for(&mut bm, &[(id, ids.clone())]);
            let out = runner.run(model, &step, &mask, &mut kv, true)?;
            monitor.observe(&out);
            monitor.requests_finished(&[id]);
            // Window events have no sink here: drop them as the actor would publish them.
            monitor.take_windows();
        }
    }
    let mut mask = PathMask::default();
    monitor.apply_to(&mut mask);
    Ok((monitor, mask))
}

/// The plan at `plan_path`, validated against the checkpoint's shape.
fn read_plan(
    ck: &quantmesh_model::Checkpoint,
    cfg: &ModelConfig,
    plan_path: &std::path::Path,
) -> Result<quantmesh_types::ValidatedPlan, Box<dyn std::error::Error>> {
    let shape = quantmesh_model::model_shape(ck, cfg)?;
    Ok(
        quantmesh_types::SensitiveLayers::parse_for(&std::fs::read(plan_path)?, &shape)
            .map_err(|e| format!("{}: {e}", plan_path.display()))?,
    )
}

/// The engine's default settings with `float_budget`, the plan at `plan_path` resolved
/// against them, and that plan as read.
pub(crate) fn served_plan(
    ck: &quantmesh_model::Checkpoint,
    cfg: &ModelConfig,
    plan_path: &std::path::Path,
    float_budget: quantmesh_engine::budget::FloatBudget,
) -> Result<
    (
        quantmesh_engine::EngineConfig,
        quantmesh_engine::plan::LivePlan,
        quantmesh_types::ValidatedPlan,
    ),
    Box<dyn std::error::Error>,
> {
    let plan = read_plan(ck, cfg, plan_path)?;
    let base = quantmesh_engine::EngineConfig {
        float_budget,
        ..Default::default()
    };
    let live = quantmesh_engine::plan::resolve(&base, cfg, Some((&plan, "plan")));
    Ok((base, live, plan))
}

#[cfg(test)]
mod tests {
    use super::*;
    use quantmesh_model::bundled::{init_model, InitOptions};

    /// Prompts prefilled in steps of a small budget end where one step leaves them: every
    /// prompt in the cache, and the next decode step's logits the same bit for bit.
    #[test]
    fn prefill_in_steps_ends_where_one_step_does() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        init_model(dir.path(), &InitOptions::default())?;
        let cfg = ModelConfig::load(dir.path())?;
        let ck = quantmesh_model::Checkpoint::open(dir.path())?;
        let model = LlamaModel::load_from(&ck, &cfg, &|_| Residency::Int8, Default::default())?;
        let prompts: Vec<(u64, Vec<u32>)> = [5usize, 9, 3]
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                (
                    i as u64,
                    (0..n as u32).map(|t| 32 + t * 3 + i as u32).collect(),
                )
            })
            .collect();
        let mut next = Vec::new();
        for budget in [0, 7, 1] {
            let (mut kv, mut bm) = cache(&cfg, 16, 16);
            for (id, p) in &prompts {
                bm.admit(*id, p, 1)?;
            }
            let (mut runner, mask) = (StepRunner::default(), PathMask::default());
            let mut served = Served {
                runner: &mut runner,
                model: &model,
                mask: &mask,
                kv: &mut kv,
            };
            served.prefill(&mut bm, &prompts, budget)?;
            for (id, p) in &prompts {
                assert_eq!(bm.num_tokens(*id), Some(p.len()), "budget {budget}");
            }
            let toks: Vec<(u64, Vec<u32>)> =
                prompts.iter().map(|(id, _)| (*id, vec![40])).collect();
            let step = step_for(&mut bm, &toks);
            next.push(runner.run(&model, &step, &mask, &mut kv, true)?.logits);
        }
        assert_eq!(next[0], next[1]);
        assert_eq!(next[0], next[2]);
        Ok(())
    }
}
