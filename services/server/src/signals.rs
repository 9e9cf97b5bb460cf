//! Process signals: SIGINT/SIGTERM end a server after draining; SIGHUP reloads the plan
//! on a serving engine and never ends a process (its default action would).

use quantmesh_engine::api::{Engine, EngineError};

/// Listens for SIGHUP from now on (SIGHUP's default action ends the process, so a server
/// takes this over before its slow start, the first-load pre-screen included).
#[cfg(unix)]
pub(crate) fn listen_for_sighup() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{signal, SignalKind};
    signal(SignalKind::hangup())
        .inspect_err(|e| tracing::warn!(error = %e, "cannot listen for SIGHUP"))
        .ok()
}

/// SIGHUP reloads the plan (`sensitive_layers.json`, the first-load plan's cached file
/// included) at once, like nginx or Prometheus; one received while loading reloads once
/// loaded. With no plan to reload it says so and keeps serving.
#[cfg(unix)]
pub(crate) async fn reload_on_sighup(mut hup: tokio::signal::unix::Signal, engine: Engine) {
    while hup.recv().await.is_some() {
        tracing::info!("SIGHUP received: reloading the plan");
        match engine.reload_config().await {
            Ok(outcome) => tracing::info!(?outcome, "reload finished"),
            Err(EngineError::InvalidRequest(why)) => {
                tracing::warn!(reason = %why, "SIGHUP: nothing to reload; still serving")
            }
            Err(e) => tracing::error!(error = %e, "reload failed"),
        }
    }
}

/// The mesh gateway holds no plan (each engine reloads its own): SIGHUP is logged and
/// the gateway keeps serving, instead of SIGHUP's default action ending the process.
#[cfg(unix)]
pub async fn log_sighup_without_reload() {
    let Some(mut hup) = listen_for_sighup() else {
        return;
    };
    while hup.recv().await.is_some() {
        tracing::info!(
            "SIGHUP received: the gateway has no plan to reload (engines reload their own); still serving"
        );
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received"),
        _ = term => tracing::info!("SIGTERM received"),
    }
}
