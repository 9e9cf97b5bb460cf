//! The pull request: commit the proposed `sensitive_layers.json` on a branch of a real git
//! repository (the `git` command line), push it, and open — or update — a pull request
//! through the forge's REST API (GitHub's `POST /repos/{owner}/{repo}/pulls`; Gitea/Forgejo
//! serve the same path under `/api/v1`).
//!
//! Idempotent: one branch per model (`quantmesh/evolve/<model>`), rebuilt from the base
//! branch on every run. When the branch already holds exactly the proposed bytes nothing is
//! pushed and no pull request is opened; when the bytes changed the branch is force-pushed
//! and the open pull request (found by its head branch) gets the new body; a pull request
//! is opened only when none is open for the branch. The token comes from the environment
//! variable named in the config and is never logged.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum ForgeError {
    #[error("git {0}: {1}")]
    Git(String, String),
    #[error("forge API {0}: {1}")]
    Api(String, String),
    #[error("forge settings: {0}")]
    Settings(String),
}

pub use quantmesh_settings::evolution::{ForgeKind, ForgeSettings, GitSettings};

/// What happened to the pull request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum PrOutcome {
    /// The base branch already holds the proposal: nothing to do.
    NothingToPropose,
    /// The branch already held these bytes (and a PR is open, or there is no forge).
    Unchanged { branch: String },
    /// Branch pushed, no forge configured.
    Pushed { branch: String },
    Opened {
        branch: String,
        number: u64,
        url: String,
    },
    Updated {
        branch: String,
        number: u64,
        url: String,
    },
    /// The branch already held these bytes and its last pull request was closed without
    /// merging: the same proposal is not opened again (a changed one is).
    Declined {
        branch: String,
        number: u64,
        url: String,
    },
}

impl PrOutcome {
    pub fn label(&self) -> &'static str {
        match self {
            PrOutcome::NothingToPropose | PrOutcome::Unchanged { .. } => "unchanged",
            PrOutcome::Declined { .. } => "declined",
            PrOutcome::Pushed { .. } | PrOutcome::Updated { .. } => "updated",
            PrOutcome::Opened { .. } => "opened",
        }
    }
}

/// Run git (in `dir`, when given) with `env` added to its environment; its stdout, or its
/// stderr as the error.
fn run_git(
    dir: Option<&Path>,
    args: &[&str],
    env: &[(String, String)],
) -> Result<String, ForgeError> {
    let mut cmd = Command::new("git");
    if let Some(dir) = dir {
        cmd.arg("-C").arg(dir);
    }
    let out = cmd
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .map_err(|e| ForgeError::Git(args.join(" "), format!("cannot run git: {e}")))?;
    if !out.status.success() {
        return Err(ForgeError::Git(
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

fn git(dir: &Path, args: &[&str]) -> Result<String, ForgeError> {
    run_git(Some(dir), args, &[])
}

/// How git authenticates to an HTTPS remote: when the variable `evolution.git.token_env`
/// holds a token, a credential helper given to git in its environment
/// (`GIT_CONFIG_COUNT`/`GIT_CONFIG_KEY_n`/`GIT_CONFIG_VALUE_n`) answers git's question with
/// `evolution.git.username` and the token. The helper's text names the variable, not the
/// token; the shell that runs it reads the variable git inherited and prints it with a
/// builtin. So the token is in no file (not the clone's config, not the remote URL), no
/// process's arguments and no log. Any helper configured before is cleared for these calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GitAuth {
    env: Vec<(String, String)>,
}

impl GitAuth {
    /// The helper for `s`, or none when the variable is unset or empty (git's own
    /// credentials then: SSH keys, a local path).
    pub fn from_settings(s: &GitSettings) -> Result<Self, ForgeError> {
        s.validate().map_err(ForgeError::Settings)?;
        let set = !s.token_env.is_empty()
            && std::env::var_os(&s.token_env).is_some_and(|v| !v.is_empty());
        if !set {
            return Ok(Self::default());
        }
        let helper = format!(
            "!f() {{ test \"$1\" = get || exit 0; echo username={}; echo \"password=${}\"; }}; f",
            s.username, s.token_env
        );
        let env = [
            ("GIT_CONFIG_COUNT", "2".to_string()),
            ("GIT_CONFIG_KEY_0", "credential.helper".into()),
            ("GIT_CONFIG_VALUE_0", String::new()),
            ("GIT_CONFIG_KEY_1", "credential.helper".into()),
            ("GIT_CONFIG_VALUE_1", helper),
        ];
        Ok(Self {
            env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        })
    }

    /// Whether a token will be offered.
    pub fn has_token(&self) -> bool {
        !self.env.is_empty()
    }

    /// What git's environment gains.
    pub fn env(&self) -> &[(String, String)] {
        &self.env
    }
}

fn git_ok(dir: &Path, args: &[&str]) -> bool {
    git(dir, args).is_ok()
}

/// A working clone of the remote, fetched.
pub struct Checkout {
    dir: PathBuf,
    s: GitSettings,
    auth: GitAuth,
}

impl Checkout {
    /// Clone (first run) or fetch.
    pub fn open(s: &GitSettings) -> Result<Self, ForgeError> {
        if s.remote.is_empty() {
            return Err(ForgeError::Settings(
                "evolution.git.remote is empty: nothing to push to (use --dry-run)".into(),
            ));
        }
        let auth = GitAuth::from_settings(s)?;
        let dir = s.checkout.clone();
        if !dir.join(".git").exists() {
            if let Some(parent) = dir.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| ForgeError::Git("clone".into(), e.to_string()))?;
            }
            let target = dir.to_string_lossy();
            run_git(None, &["clone", "--quiet", &s.remote, &target], auth.env())?;
        }
        git(&dir, &["remote", "set-url", "origin", &s.remote])?;
        run_git(
            Some(&dir),
            &["fetch", "--quiet", "--prune", "origin"],
            auth.env(),
        )?;
        Ok(Self {
            dir,
            s: s.clone(),
            auth,
        })
    }

    /// The plan file on the base branch (what the proposal starts from), if there is one.
    pub fn base_plan(&self) -> Option<Vec<u8>> {
        let spec = format!("origin/{}:{}", self.s.base, self.s.plan_path);
        git(&self.dir, &["show", &spec])
            .ok()
            .map(String::into_bytes)
    }

    fn branch(&self, model_partition: &str) -> String {
        format!("{}{}", self.s.branch_prefix, model_partition)
    }

    /// Commit `bytes` on the model's branch (rebuilt from the base) and push it, unless the
    /// base or the branch already holds them. Returns the branch and whether it was pushed.
    pub fn push(
        &self,
        model_partition: &str,
        bytes: &[u8],
        message: &str,
    ) -> Result<(String, Option<bool>), ForgeError> {
        let branch = self.branch(model_partition);
        if self.base_plan().as_deref() == Some(bytes) {
            return Ok((branch, None));
        }
        let remote_spec = format!("origin/{branch}:{}", self.s.plan_path);
        let on_branch = git(&self.dir, &["show", &remote_spec])
            .ok()
            .map(String::into_bytes);
        if on_branch.as_deref() == Some(bytes) {
            return Ok((branch, Some(false)));
        }
        let base = format!("origin/{}", self.s.base);
        if !git_ok(&self.dir, &["rev-parse", "--verify", "--quiet", &base]) {
            return Err(ForgeError::Git(
                "rev-parse".into(),
                format!(
                    "the remote has no branch {:?} (evolution.git.base)",
                    self.s.base
                ),
            ));
        }
        git(&self.dir, &["checkout", "--quiet", "-B", &branch, &base])?;
        let path = self.dir.join(&self.s.plan_path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| ForgeError::Git("write".into(), e.to_string()))?;
        }
        std::fs::write(&path, bytes)
            .map_err(|e| ForgeError::Git("write".into(), format!("{}: {e}", path.display())))?;
        git(&self.dir, &["add", "--", &self.s.plan_path])?;
        let name = format!("user.name={}", self.s.author_name);
        let email = format!("user.email={}", self.s.author_email);
        git(
            &self.dir,
            &[
                "-c", &name, "-c", &email, "commit", "--quiet", "-m", message,
            ],
        )?;
        run_git(
            Some(&self.dir),
            &[
                "push",
                "--quiet",
                "--force",
                "origin",
                &format!("{branch}:{branch}"),
            ],
            self.auth.env(),
        )?;
        Ok((branch, Some(true)))
    }
}

#[derive(Deserialize)]
struct PullHead {
    #[serde(rename = "ref")]
    r#ref: String,
}

#[derive(Deserialize)]
struct Pull {
    number: u64,
    html_url: Option<String>,
    head: PullHead,
    /// `open` or `closed` (both forges).
    #[serde(default)]
    state: Option<String>,
    /// GitHub and Gitea: when it was merged.
    #[serde(default)]
    merged_at: Option<String>,
    /// Gitea: whether it was merged.
    #[serde(default)]
    merged: Option<bool>,
}

/// A pull request from `branch` as the forge lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullInfo {
    pub number: u64,
    pub url: String,
    pub open: bool,
    pub merged: bool,
}

/// Pull requests per listed page (GitHub's `per_page` allows 100, Gitea's `limit` 50; each
/// ignores the other's parameter).
const PAGE: usize = 50;
/// Pages read at most per lookup: the newest `PAGE · MAX_PAGES` pull requests.
const MAX_PAGES: usize = 40;

/// The forge's REST API.
pub struct Forge {
    s: ForgeSettings,
    token: String,
    http: reqwest::Client,
}

impl Forge {
    /// `None` when no forge is configured. The token is read from `token_env` now.
    pub fn new(s: &ForgeSettings) -> Result<Option<Self>, ForgeError> {
        if s.kind == ForgeKind::None {
            return Ok(None);
        }
        if s.repository.split('/').count() != 2 {
            return Err(ForgeError::Settings(format!(
                "evolution.forge.repository {:?} is not owner/name",
                s.repository
            )));
        }
        let token = std::env::var(&s.token_env).map_err(|_| {
            ForgeError::Settings(format!(
                "the forge token variable {} is not set",
                s.token_env
            ))
        })?;
        let http = reqwest::Client::builder()
            .user_agent(concat!("quantmesh-evolve/", env!("CARGO_PKG_VERSION")))
            .timeout(std::time::Duration::from_secs(30))
            .build()
            .map_err(|e| ForgeError::Api("client".into(), e.to_string()))?;
        Ok(Some(Self {
            s: s.clone(),
            token,
            http,
        }))
    }

    fn url(&self, path: &str) -> String {
        format!(
            "{}/repos/{}{}",
            self.s.api_url.trim_end_matches('/'),
            self.s.repository,
            path
        )
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let auth = match self.s.kind {
            ForgeKind::Gitea => format!("token {}", self.token),
            _ => format!("Bearer {}", self.token),
        };
        self.http
            .request(method, self.url(path))
            .header("Authorization", auth)
            .header("Accept", "application/vnd.github+json")
            .header("X-GitHub-Api-Version", "2022-11-28")
    }

    async fn send<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<T, ForgeError> {
        let resp = req.send().await.map_err(|e| {
            let msg = e.to_string();
            ForgeError::Api(
                what.into(),
                if msg.contains("scheme is not http") || msg.contains("builder error") {
                    format!("{msg} (this build speaks plain HTTP only: rebuild with `--features tls` for https)")
                } else {
                    msg
                },
            )
        })?;
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(ForgeError::Api(what.into(), format!("{status}: {body}")));
        }
        serde_json::from_str(&body)
            .map_err(|e| ForgeError::Api(what.into(), format!("unexpected answer ({e}): {body}")))
    }

    /// The pull requests from `branch` in `state` (`open`, `all`), newest first. The list
    /// is read page by page (Gitea has no `head` filter and pages by `limit`; GitHub
    /// filters by `head` and pages by `per_page`), and filtered here by head branch.
    async fn pulls_from(&self, branch: &str, state: &str) -> Result<Vec<PullInfo>, ForgeError> {
        let owner = self.s.repository.split('/').next().unwrap_or_default();
        let head: String =
            url::form_urlencoded::byte_serialize(format!("{owner}:{branch}").as_bytes()).collect();
        let mut found = Vec::new();
        for page in 1..=MAX_PAGES {
            let list: Vec<Pull> = self
                .send(
                    "list pull requests",
                    self.request(
                        reqwest::Method::GET,
                        &format!(
                            "/pulls?state={state}&head={head}&sort=created&direction=desc&per_page={PAGE}&limit={PAGE}&page={page}"
                        ),
                    ),
                )
                .await?;
            let n = list.len();
            found.extend(
                list.into_iter()
                    .filter(|p| p.head.r#ref == branch)
                    .map(|p| PullInfo {
                        number: p.number,
                        url: p.html_url.unwrap_or_default(),
                        open: p.state.as_deref().is_none_or(|s| s == "open"),
                        merged: p.merged.unwrap_or(false) || p.merged_at.is_some(),
                    }),
            );
            if n < PAGE {
                break;
            }
            if page == MAX_PAGES {
                tracing::warn!(target: "quantmesh::evolution", pages = MAX_PAGES, "pull request list cut short: only the newest pages were read");
            }
        }
        found.sort_by_key(|p| std::cmp::Reverse(p.number));
        Ok(found)
    }

    /// The open pull request whose head is `branch`: (number, url).
    pub async fn find_open(&self, branch: &str) -> Result<Option<(u64, String)>, ForgeError> {
        Ok(self
            .pulls_from(branch, "open")
            .await?
            .into_iter()
            .find(|p| p.open)
            .map(|p| (p.number, p.url)))
    }

    /// The newest pull request from `branch`, open or closed.
    pub async fn latest(&self, branch: &str) -> Result<Option<PullInfo>, ForgeError> {
        Ok(self.pulls_from(branch, "all").await?.into_iter().next())
    }

    /// Open a pull request from `branch` into `base`, or update the open one's title and
    /// body.
    pub async fn open_or_update(
        &self,
        branch: &str,
        base: &str,
        title: &str,
        body: &str,
    ) -> Result<PrOutcome, ForgeError> {
        if let Some((number, _)) = self.find_open(branch).await? {
            let updated: Pull = self
                .send(
                    "update pull request",
                    self.request(reqwest::Method::PATCH, &format!("/pulls/{number}"))
                        .json(&serde_json::json!({ "title": title, "body": body })),
                )
                .await?;
            return Ok(PrOutcome::Updated {
                branch: branch.into(),
                number: updated.number,
                url: updated.html_url.unwrap_or_default(),
            });
        }
        let created: Pull = self
            .send(
                "create pull request",
                self.request(reqwest::Method::POST, "/pulls")
                    .json(&serde_json::json!({
                        "title": title,
                        "head": branch,
                        "base": base,
                        "body": body,
                        "maintainer_can_modify": true,
                    })),
            )
            .await?;
        if !self.s.labels.is_empty() {
            if self.s.kind == ForgeKind::Gitea {
                tracing::warn!(target: "quantmesh::evolution", "labels are not applied on Gitea/Forgejo (its API takes label ids, not names)");
            } else {
                let _: serde_json::Value = self
                    .send(
                        "label pull request",
                        self.request(
                            reqwest::Method::POST,
                            &format!("/issues/{}/labels", created.number),
                        )
                        .json(&serde_json::json!({ "labels": self.s.labels })),
                    )
                    .await?;
            }
        }
        Ok(PrOutcome::Opened {
            branch: branch.into(),
            number: created.number,
            url: created.html_url.unwrap_or_default(),
        })
    }
}
