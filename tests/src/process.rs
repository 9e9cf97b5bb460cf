//! A server under test as a child process: its output in a log file, its port, readiness
//! awaited on `/ready` (a timeout shows the log), SIGKILL or SIGTERM, killed when dropped.

use crate::poll;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Process {
    child: Option<Child>,
    pub port: u16,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    pub log: PathBuf,
}

impl Process {
    /// Start `cmd`, its stdout and stderr written to `log`; it is to listen on `port`.
    pub fn spawn(mut cmd: Command, port: u16, log: PathBuf) -> Process {
        let f = std::fs::File::create(&log).expect("creating the process log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("log handle"))
            .stderr(f)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
        Process {
            child: Some(child),
            port,
            base: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The process id (`None` once stopped).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// What the process has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Until `/ready` answers 200, for at most `within`; past that, fail showing the log.
    pub async fn wait_ready(&self, client: &reqwest::Client, within: Duration) {
        poll(within, Duration::from_millis(100), || async {
            match client.get(self.url("/ready")).send().await {
                Ok(r) if r.status() == 200 => Ok(()),
                seen => Err(format!(
                    "{} not ready ({:?}); log:\n{}",
                    self.base,
                    seen.map(|r| r.status()),
                    self.log_text()
                )),
            }
        })
        .await
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait (at most a minute) for the graceful exit, then SIGKILL.
    pub fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(60) {
                if c.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}
