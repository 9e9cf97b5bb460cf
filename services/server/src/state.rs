//! Shared state of the gateway's HTTP workers.

use crate::error::ApiError;
use crate::metrics::Metrics;
use quantmesh_engine::api::Engine;
use quantmesh_settings::ServerSettings;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use tokio::sync::Semaphore;

pub struct AppState {
    engine: OnceLock<Engine>,
    pub server: ServerSettings,
    pub model_name: String,
    pub metrics: Metrics,
    /// One permit per request in flight; `try_acquire` failing means 429.
    pub admission: Arc<Semaphore>,
    /// From `QUANTMESH_ADMIN_TOKEN`; `None` disables admin routes.
    pub admin_token: Option<String>,
    shutting_down: AtomicBool,
}

impl AppState {
    pub fn new(server: ServerSettings, model_name: String, admin_token: Option<String>) -> Self {
        let permits = server.max_concurrent_requests;
        Self {
            engine: OnceLock::new(),
            metrics: Metrics::new(&model_name, &server.engine_name),
            model_name,
            admission: Arc::new(Semaphore::new(permits)),
            admin_token: admin_token.filter(|t| !t.is_empty()),
            shutting_down: AtomicBool::new(false),
            server,
        }
    }

    /// Install the engine once it has loaded: from now on /ready is 200.
    pub fn set_engine(&self, engine: Engine) {
        let _ = self.engine.set(engine);
    }

    pub fn engine(&self) -> Result<&Engine, ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::ShuttingDown);
        }
        self.engine.get().ok_or(ApiError::NotReady)
    }

    pub fn engine_if_loaded(&self) -> Option<&Engine> {
        self.engine.get()
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }
}
