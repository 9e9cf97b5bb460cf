//! `quantmesh evolve`: the evolution service (lake ingest + weekly analysis + pull request).

use anyhow::Context as _;
use quantmesh_evolution::analysis::{EvidenceFile, Span};
use quantmesh_evolution::ingest::{self, IngestOptions};
use quantmesh_evolution::lake::Lake;
use quantmesh_evolution::metrics::EvolutionMetrics;
use quantmesh_evolution::run::{next_run, run_once, EvidenceSource};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub const EVOLVE_HELP: &str = "The evolution service: lands the fallback, config and monitor-window events from Kafka in a \
Parquet lake (<lake>/<table>/model=…/date=…/), analyses a week of them with DataFusion, turns the evidence into a new \
sensitive_layers.json by documented rules, and commits it on a branch of the plan repository with a pull request \
(GitHub or Gitea REST API). Merged and published where the engines poll, it is hot-reloaded.\n\n\
Modes:\n  quantmesh evolve                    # service: ingest continuously, run on --schedule, /metrics on evolution.listen\n  \
quantmesh evolve --once             # catch up the lake, one run over the last evolution.window, exit\n  \
quantmesh evolve --once --dry-run   # print the evidence and the proposed changes, push nothing\n  \
quantmesh evolve --once --evidence spark.json   # propose from evidence tables Spark computed (infra/spark/evidence.py)\n\n\
Config: the [evolution] and [kafka] sections of --config (see infra/quantmesh.example.toml); the forge token is read \
from the variable named by evolution.forge.token_env (default QUANTMESH_FORGE_TOKEN), never from a file.";

#[derive(clap::Args)]
pub struct EvolveArgs {
    /// quantmesh TOML config ([evolution] and [kafka] sections).
    #[arg(long, env = "QUANTMESH_CONFIG")]
    config: Option<PathBuf>,
    /// One run, then exit (after catching up the lake when brokers are configured).
    #[arg(long)]
    once: bool,
    /// Print the evidence and the proposal; push nothing, open nothing.
    #[arg(long)]
    dry_run: bool,
    /// Start of the analysed span (RFC 3339, or YYYY-MM-DD) [default: until − evolution.window].
    #[arg(long)]
    since: Option<String>,
    /// End of the analysed span (RFC 3339, or YYYY-MM-DD) [default: now].
    #[arg(long)]
    until: Option<String>,
    /// Cron schedule of runs in service mode, UTC [default: evolution.schedule, "0 3 * * 1"].
    #[arg(long)]
    schedule: Option<String>,
    /// The lake (directory or URL) [default: evolution.lake].
    #[arg(long)]
    lake: Option<String>,
    /// The served model's name, as in the events [default: evolution.model].
    #[arg(long)]
    model: Option<String>,
    /// Kafka bootstrap brokers [default: kafka.brokers]; none: analyse the lake as it is.
    #[arg(long, env = "QUANTMESH_KAFKA_BROKERS")]
    brokers: Option<String>,
    /// With --once: stop catching up after this long without a new record.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    ingest_idle: Duration,
    /// Skip the ingest (analyse the lake as it is).
    #[arg(long)]
    no_ingest: bool,
    /// Write the run's evidence and changes (Markdown) to this file too.
    #[arg(long)]
    report: Option<PathBuf>,
    /// With --once: propose from evidence tables another engine computed over the lake (the
    /// JSON infra/spark/evidence.py writes; shared/schemas/EVIDENCE.md) instead of analysing
    /// the lake here. No ingest; the span is the file's; its model and request_kl_limit must
    /// be this run's.
    #[arg(long, requires = "once", conflicts_with_all = ["since", "until", "lake", "brokers"])]
    evidence: Option<PathBuf>,
    /// With --once: write the run's evidence tables (the JSON --evidence reads) to this file.
    #[arg(long, requires = "once")]
    evidence_out: Option<PathBuf>,
    /// With --once: write the proposed sensitive_layers.json to this file (also on a dry run).
    #[arg(long, requires = "once")]
    plan_out: Option<PathBuf>,
}

fn parse_time(s: &str) -> anyhow::Result<i64> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Ok(t.timestamp_millis());
    }
    let d = chrono::NaiveDate::parse_from_str(s, "%Y-%m-%d")
        .with_context(|| format!("{s:?} is neither RFC 3339 nor YYYY-MM-DD"))?;
    Ok(d.and_hms_opt(0, 0, 0)
        .map(|t| t.and_utc().timestamp_millis())
        .unwrap_or_default())
}

pub fn run(args: EvolveArgs) -> anyhow::Result<()> {
    quantmesh_telemetry::init(quantmesh_settings::LogFormat::Text, "info");
    let all = quantmesh_settings::Settings::load(args.config.as_deref())?;
    let mut kafka = all.kafka;
    let mut s = all.evolution.with_env().map_err(anyhow::Error::msg)?;
    // The plan in force, when neither the repository nor evolution.plan names one: the
    // engine's own source in the same config (a proposal starts from what is served, never
    // from an empty plan that would drop its classes).
    if s.plan.is_none() {
        s.plan = all.engine.sensitive_layers.clone();
    }
    if let Some(b) = args.brokers {
        kafka.brokers = b;
    }
    if let Some(v) = args.lake {
        s.lake = v;
    }
    if let Some(v) = args.model {
        s.model = v;
    }
    if let Some(v) = args.schedule {
        s.schedule = v;
    }
    s.validate().map_err(anyhow::Error::msg)?;
    kafka.validate().map_err(anyhow::Error::msg)?;
    let until = match &args.until {
        Some(t) => Some(parse_time(t)?),
        None => None,
    };
    let since = match &args.since {
        Some(t) => Some(parse_time(t)?),
        None => None,
    };
    let evidence_file = match &args.evidence {
        Some(path) => {
            let name = path.display().to_string();
            let bytes =
                std::fs::read(path).with_context(|| format!("reading the evidence file {name}"))?;
            Some((name.clone(), EvidenceFile::parse(&name, &bytes)?))
        }
        None => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let registry = prometheus::Registry::new();
        let metrics = EvolutionMetrics::register(&registry)?;
        let opts = IngestOptions {
            group_id: s.group_id.clone(),
            batch_records: s.batch_records,
            batch_interval: s.batch_interval,
            dedup_capacity: s.dedup_capacity,
        };
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let span_for = |now: i64| Span {
            until_ms: until.unwrap_or(now),
            since_ms: since.unwrap_or(until.unwrap_or(now) - s.window.as_millis() as i64),
        };
        // With --evidence the lake is not read (nor created).
        let lake = match evidence_file {
            Some(_) => None,
            None => Some(Arc::new(Lake::open(&s.lake)?)),
        };
        if args.once {
            let source = match (evidence_file, &lake) {
                (Some((path, file)), _) => EvidenceSource::File { path, file: Box::new(file) },
                (None, None) => anyhow::bail!("neither a lake nor an evidence file to analyse"),
                (None, Some(lake)) => {
                    if kafka.enabled() && !args.no_ingest {
                        let r = ingest::run(
                            &kafka,
                            &opts,
                            lake.clone(),
                            Some(metrics.clone()),
                            stop_rx,
                            Some(args.ingest_idle),
                        )
                        .await?;
                        tracing::info!(records = r.records, files = r.files, bytes = r.bytes, "lake caught up");
                    }
                    EvidenceSource::Lake { lake, span: span_for(quantmesh_types::now_ms() as i64) }
                }
            };
            let (report, current) = run_once(&s, source, args.dry_run, Some(&metrics)).await?;
            let md = report.markdown(&current);
            println!("{md}");
            if let Some(o) = &report.outcome {
                println!("pull request: {}", serde_json::to_string(o).unwrap_or_default());
            }
            let outputs = [
                (&args.report, md.into_bytes()),
                (&args.evidence_out, report.tables.to_bytes()),
                (&args.plan_out, report.proposal.bytes()),
            ];
            for (path, bytes) in outputs {
                if let Some(path) = path {
                    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
                }
            }
            return anyhow::Ok(());
        }
        // Service mode: metrics/health, continuous ingest, scheduled runs.
        let Some(lake) = lake else {
            anyhow::bail!("--evidence needs --once");
        };
        let listener = tokio::net::TcpListener::bind(&s.listen)
            .await
            .with_context(|| format!("binding evolution.listen {}", s.listen))?;
        tracing::info!(listen = %s.listen, schedule = %s.schedule, lake = %lake.location(), "evolution service started");
        let (http_stop_tx, http_stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(quantmesh_evolution::http::serve(listener, registry.clone(), async move {
            let _ = http_stop_rx.await;
        }));
        let ingest_task = if kafka.enabled() && !args.no_ingest {
            let (k, o, l, m) = (kafka.clone(), opts.clone(), lake.clone(), metrics.clone());
            Some(tokio::spawn(async move {
                // The ingest never gives up: a lake or broker failure is retried with backoff
                // (uncommitted records are read again), and shows in quantmesh_evolution_ingest_up.
                let mut backoff = Duration::from_secs(1);
                loop {
                    m.ingest_up.set(1);
                    match ingest::run(&k, &o, l.clone(), Some(m.clone()), stop_rx.clone(), None).await {
                        Ok(_) => break,
                        Err(e) => {
                            m.ingest_up.set(0);
                            tracing::error!(error = %e, retry_in = ?backoff, "lake ingest failed");
                        }
                    }
                    let mut stop = stop_rx.clone();
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.changed() => break,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                }
            }))
        } else {
            tracing::warn!("no Kafka brokers: the lake is not fed (analysis runs over what it holds)");
            let _ = registry.unregister(Box::new(metrics.ingest_up.clone()));
            None
        };
        // One listener for the whole life of the service: a SIGTERM that arrives during a
        // run is kept (the run finishes, then the service stops), not lost between waits.
        let shutdown = quantmesh_server::shutdown_signal();
        tokio::pin!(shutdown);
        loop {
            let now = chrono::Utc::now();
            let next = next_run(&s.schedule, now).map_err(anyhow::Error::msg)?;
            tracing::info!(next = %next.to_rfc3339(), "next evolution run");
            let wait = (next - now).to_std().unwrap_or_default();
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = &mut shutdown => break,
            }
            let span = span_for(quantmesh_types::now_ms() as i64);
            let run = run_once(&s, EvidenceSource::Lake { lake: &lake, span }, args.dry_run, Some(&metrics));
            tokio::pin!(run);
            let (done, stopping) = tokio::select! {
                done = &mut run => (done, false),
                _ = &mut shutdown => {
                    tracing::info!("stop requested during a run: finishing it first");
                    (run.await, true)
                }
            };
            match done {
                Ok((report, _)) => tracing::info!(changes = report.proposal.changes.len(), outcome = ?report.outcome, "evolution run done"),
                Err(e) => tracing::error!(error = %e, "evolution run failed"),
            }
            if stopping {
                break;
            }
        }
        tracing::info!("shutting down: finishing the batch in hand");
        let _ = stop_tx.send(true);
        if let Some(t) = ingest_task {
            let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
        }
        let _ = http_stop_tx.send(());
        let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
        anyhow::Ok(())
    })
}
