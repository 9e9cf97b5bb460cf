//! `quantmesh-monitor-eval`: the monitor's evaluation suite (see
//! `quantmesh_engine::evaluation`). Writes a family of planted-truth checkpoints, serves each
//! through the real engine with ordinary traffic, and prints what the monitor did against
//! what was planted.

use quantmesh_engine::evaluation::{run_case, table, EvalOptions};
use quantmesh_model::recipe::Recipe;

const HELP: &str = "\
quantmesh-monitor-eval — score the activation monitor on planted-truth checkpoints

USAGE: quantmesh-monitor-eval [--models N] [--seed S] [--requests R] [--window W] [--min-excess E] [--k K] [--dir DIR] [--only I]
       quantmesh-monitor-eval --model DIR [--oracle] [--class C] [--split-activations S] [--requests R] [--window W]

  --models N      models in the family (default 12; every third has nothing planted)
  --seed S        family seed (default 1)
  --requests R    ordinary requests per model (default 200)
  --window W      requests per monitor window (default 20)
  --min-excess E  the outlier rule's relative floor (default: the monitor's, 1.0)
  --k K           the outlier rule's k (default 4)
  --dir DIR       where to write the checkpoints (default: a temporary directory)
  --only I        run only model I of the family (0-based)
  --model DIR     instead: serve a real checkpoint (HF directory or GGUF) with ordinary chat
                  traffic and report per-group statistics, fallbacks and KL
  --oracle        with --model: also rank every group by its own KL contribution and compare
                  the monitor's float set with the oracle's at the same float parameters, and
                  rank the groups by their measured harm against the oracle at 5–40 % float
  --split-activations off|copyless|all
                  which quantized rows carry split activations (default: off for the
                  planted family, whose truth is 8-bit activation harm; the engine's
                  default, all, for --model)
  --class C       serve every group as class C (w8a8, the default; or w4a16: 4-bit weights),
                  each with an exact float copy

Set QUANTMESH_EVAL_VERBOSE=1 to print every group's final statistics.
";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut n = 12usize;
    let mut seed = 1u64;
    let mut opts = EvalOptions::default();
    let mut dir: Option<std::path::PathBuf> = None;
    let mut only: Option<usize> = None;
    let mut model: Option<std::path::PathBuf> = None;
    let mut oracle = false;
    let mut split_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--models" => n = val()?.parse()?,
            "--seed" => seed = val()?.parse()?,
            "--requests" => opts.requests = val()?.parse()?,
            "--window" => opts.monitor.window_requests = val()?.parse()?,
            "--min-excess" => opts.monitor.min_excess = val()?.parse()?,
            "--k" => opts.monitor.k = val()?.parse()?,
            "--dir" => dir = Some(val()?.into()),
            "--only" => only = Some(val()?.parse::<usize>()?),
            "--model" => model = Some(std::path::PathBuf::from(val()?)),
            "--oracle" => oracle = true,
            "--split-activations" => {
                opts.split = val()?.parse()?;
                split_given = true;
            }
            "--class" => {
                let v = val()?;
                opts.class =
                    serde_json::from_value(serde_json::Value::String(v.clone())).map_err(|_| {
                        format!("--class: {v:?} is not w4a16, w8a8, w8a8_per_channel or fp16")
                    })?
            }
            "-h" | "--help" => {
                print!("{HELP}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n\n{HELP}").into()),
        }
    }
    if let Some(m) = model {
        if !split_given {
            opts.split = quantmesh_engine::backend::SplitActivations::default();
        }
        let sys = actix::System::new();
        let text = sys.block_on(quantmesh_engine::evaluation::real_model_report(
            &m, &opts, oracle,
        ))?;
        println!("Monitor on {} (no planted truth):\n\n{text}", m.display());
        return Ok(());
    }
    let scratch = dir.is_none();
    let root = dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("quantmesh-monitor-eval-{}", std::process::id()))
    });
    let mut recipes = Recipe::family(seed, n);
    if let Some(i) = only {
        recipes = recipes.into_iter().skip(i).take(1).collect();
    }
    let sys = actix::System::new();
    let cases = sys.block_on(async {
        let mut cases = Vec::new();
        for (i, r) in recipes.iter().enumerate() {
            let t = std::time::Instant::now();
            let case = run_case(&root.join(&r.name), r, &opts).await?;
            eprintln!(
                "[{}/{}] {} ({:.1} s): fell back {:?}, planted {:?}",
                i + 1,
                recipes.len(),
                r.name,
                t.elapsed().as_secs_f64(),
                case.fell_back,
                case.planted_sensitive
            );
            cases.push(case);
        }
        Ok::<_, quantmesh_engine::error::EngineError>(cases)
    });
    if scratch {
        let _ = std::fs::remove_dir_all(&root);
    }
    let cases = cases?;
    println!(
        "Monitor evaluation: {} models (family seed {seed}), {} requests each, window {} requests, k {}, min_excess {}:\n",
        cases.len(),
        opts.requests,
        opts.monitor.window_requests,
        opts.monitor.k,
        opts.monitor.min_excess
    );
    print!("{}", table(&cases));
    Ok(())
}
