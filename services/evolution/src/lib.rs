//! quantmesh's evolution service: the loop from evidence to a better plan.
//!
//! ```text
//!  Kafka (fallback, config, window topics)
//!     │ ingest: consumer group, offsets committed after the files are durable
//!     ▼
//!  Parquet lake  <lake>/<table>/model=…/date=…/p<part>-o<first>-<last>-<topic>.parquet
//!     │ analysis: DataFusion SQL over a week (deduplicated on event_id)
//!     ▼
//!  Evidence per group ──proposal rules──▶ sensitive_layers.json (validated like a reload)
//!     │ git: branch quantmesh/evolve/<model> rebuilt from the base, pushed
//!     ▼
//!  pull request (GitHub / Gitea REST) ──merge + publish──▶ engines hot-reload it
//! ```
//!
//! * [`lake`] — tables, file naming, the object store.
//! * [`ingest`] — the Kafka consumer that lands events in the lake.
//! * [`analysis`] — the SQL and the [`analysis::Evidence`] it yields.
//! * [`proposal`] — the rules that turn evidence into a new plan.
//! * [`forge`] — git and the pull-request API.
//! * [`run`] — one evolution run end to end, and the schedule.

pub mod analysis;
pub mod forge;
pub mod http;
pub mod ingest;
pub mod lake;
pub mod metrics;
pub mod proposal;
pub mod run;
pub mod settings;

pub use settings::EvolutionSettings;
