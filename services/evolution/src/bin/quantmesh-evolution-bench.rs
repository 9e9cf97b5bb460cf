//! How fast the lake takes events and how long a week's analysis takes.
//!
//! Writes `--events` synthetic events (per-token/per-layer fallback events and window events
//! in the proportions a served model produces them: one window event per `--window-every`
//! fallback events, each window with `--groups` groups and `--kl` shadow-KL samples) through
//! the ingest's own batch writer (JSON decode → rows → Parquet on the local object store),
//! then runs the weekly analysis over them with DataFusion. Kafka is not in the loop (its
//! consumer is measured by the services/quantmesh/tests/evolution.rs runs); this is the
//! lake's own cost.
//!
//!     cargo run --release -p quantmesh-evolution --bin quantmesh-evolution-bench -- --events 1000000

use anyhow::Context as _;
use quantmesh_evolution::analysis::{self, Span};
use quantmesh_evolution::ingest::{Consumed, Writer};
use quantmesh_evolution::lake::Lake;
use quantmesh_kafka::KafkaSettings;
use quantmesh_types::{
    FallbackAction, FallbackEvent, FallbackReason, Granularity, WindowEvent, WindowGroup,
};
use std::sync::Arc;
use std::time::Instant;

struct Args {
    events: usize,
    batch: usize,
    window_every: usize,
    groups: usize,
    kl: usize,
    lake: Option<String>,
}

fn parse() -> anyhow::Result<Args> {
    let mut a = Args {
        events: 1_000_000,
        batch: 50_000,
        window_every: 100,
        groups: 120,
        kl: 64,
        lake: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--events" => a.events = v()?.parse()?,
            "--batch" => a.batch = v()?.parse()?,
            "--window-every" => a.window_every = v()?.parse()?,
            "--groups" => a.groups = v()?.parse()?,
            "--kl" => a.kl = v()?.parse()?,
            "--lake" => a.lake = Some(v()?),
            "-h" | "--help" => {
                println!("quantmesh-evolution-bench [--events N (1000000)] [--batch N (50000)] [--window-every N (100)] [--groups N (120)] [--kl N (64)] [--lake DIR (a temp dir)]");
                std::process::exit(0);
            }
            _ => anyhow::bail!("unknown argument {k} (see --help)"),
        }
    }
    anyhow::ensure!(
        a.batch > 0 && a.window_every > 0,
        "--batch and --window-every must be ≥ 1"
    );
    Ok(a)
}

const T0: u64 = 1_790_000_000_000;
const WEEK: u64 = 7 * 86_400_000;

fn event(i: usize, a: &Args, rng: &mut u64) -> (String, &'static str, String) {
    let mut next = || {
        *rng = rng
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (*rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let t = T0 + (i as u64 * WEEK) / a.events.max(1) as u64;
    let layers = (a.groups / 4).max(1);
    if i.is_multiple_of(a.window_every) {
        let groups = (0..a.groups)
            .map(|g| {
                let tokens = 2_000;
                let hot = g % 17 == 3;
                let rate = if hot {
                    0.03 + 0.02 * next()
                } else {
                    0.004 * next()
                };
                WindowGroup {
                    group: format!(
                        "layers.{}.{}",
                        g / 4 % layers,
                        ["qkv", "o", "gate_up", "down"][g % 4]
                    ),
                    tokens,
                    outliers: (rate * tokens as f64) as u64,
                    in_float: hot && next() < 0.8,
                    wanted_unavailable: false,
                    residency: "dual".into(),
                    mean_nsr: Some(0.002 * (1.0 + rate)),
                }
            })
            .collect();
        let ev = WindowEvent {
            schema_version: 1,
            event_id: format!("w-{i}"),
            timestamp_ms: t,
            duration_ms: 20_000,
            model: "bench".into(),
            window: i as u64,
            config_md5: Some("0123456789abcdef0123456789abcdef".into()),
            groups,
            shadow_kl: (0..a.kl).map(|_| 0.002 * -(1.0 - next()).ln()).collect(),
            shadow_kl_seen: a.kl as u64,
            kl_reference: None,
            request_kl_fallbacks: 0,
        };
        (
            format!("w-{i}"),
            "window",
            serde_json::to_string(&ev).unwrap_or_default(),
        )
    } else {
        let token = !i.is_multiple_of(3);
        let ev = FallbackEvent {
            schema_version: 1,
            event_id: format!("f-{i}"),
            timestamp_ms: t,
            model: "bench".into(),
            group: Some(format!("layers.{}.down", i % layers)),
            granularity: if token {
                Granularity::Token
            } else {
                Granularity::Layer
            },
            action: FallbackAction::Enter,
            reason: if token {
                FallbackReason::ExtremeToken
            } else {
                FallbackReason::OutlierRate
            },
            outlier_rate: Some(0.02 + 0.01 * next()),
            mean: Some(1.0),
            sigma: Some(0.1),
            k: Some(4.0),
            kl: None,
            kl_reference: None,
            token_ids: vec![],
            positions: if token { vec![i % 512] } else { vec![] },
            request_id: Some(i as u64),
            config_md5: Some("0123456789abcdef0123456789abcdef".into()),
            traceparent: None,
        };
        (
            format!("f-{i}"),
            "fallback",
            serde_json::to_string(&ev).unwrap_or_default(),
        )
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let a = parse()?;
    let tmp;
    let dir = match &a.lake {
        Some(d) => d.clone(),
        None => {
            tmp = std::env::temp_dir().join(format!("quantmesh-lake-bench-{}", std::process::id()));
            tmp.display().to_string()
        }
    };
    let lake = Arc::new(Lake::open(&dir)?);
    let settings = KafkaSettings::default();
    let mut writer = Writer::new(lake.clone(), settings.clone(), 1_000_000, None);
    let mut rng = 7u64;
    let (mut gen_s, mut write_s, mut rows, mut bytes) = (0.0, 0.0, 0usize, 0u64);
    let mut offset = 0i64;
    let mut done = 0usize;
    while done < a.events {
        let n = a.batch.min(a.events - done);
        let t = Instant::now();
        let batch: Vec<Consumed> = (done..done + n)
            .map(|i| {
                let (_, kind, payload) = event(i, &a, &mut rng);
                offset += 1;
                Consumed {
                    topic: if kind == "window" {
                        settings.window_topic.clone()
                    } else {
                        settings.topic.clone()
                    },
                    partition: 0,
                    offset,
                    event_type: Some(kind.into()),
                    payload: Ok(payload),
                }
            })
            .collect();
        gen_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let r = writer.write_batch(&batch).await?;
        write_s += t.elapsed().as_secs_f64();
        rows += r.rows;
        bytes += r.bytes;
        done += n;
        eprint!("\r{done}/{} events landed", a.events);
    }
    eprintln!();
    let t = Instant::now();
    let ctx = analysis::session(&lake).await?;
    let ev = analysis::analyse(
        &ctx,
        "bench",
        Span {
            since_ms: T0 as i64,
            until_ms: (T0 + WEEK) as i64,
        },
        0.02,
    )
    .await?;
    let analyse_s = t.elapsed().as_secs_f64();
    println!("| measure | value |\n|---|---|");
    println!("| events (fallback + window) | {} |", a.events);
    println!("| lake rows written | {rows} |");
    println!(
        "| Parquet bytes (zstd) | {bytes} ({:.1} bytes/event) |",
        bytes as f64 / a.events as f64
    );
    println!(
        "| ingest: decode + rows + Parquet, events/s | {:.0} |",
        a.events as f64 / write_s
    );
    println!("| ingest: rows/s | {:.0} |", rows as f64 / write_s);
    println!("| (generating the JSON, not counted) | {gen_s:.2} s |");
    println!("| weekly analysis (DataFusion), s | {analyse_s:.2} |");
    println!(
        "| evidence: groups, windows, KL samples | {}, {}, {} |",
        ev.groups.len(),
        ev.windows,
        ev.kl.samples
    );
    if a.lake.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}
