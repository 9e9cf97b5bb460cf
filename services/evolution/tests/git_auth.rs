//! `evolve` pushes its branch to a remote that requires credentials: a real git server over
//! HTTP (git's own `http-backend` behind Basic authentication, `quantmesh_testkit::git_http`)
//! refuses every request without the token. The token is read from the variable
//! `evolution.git.token_env` names, as a Kubernetes Secret provides it, and it is found in no
//! file of the working clone, in no argument or configuration git is given (only the
//! variable's name is), and in no error.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use quantmesh_evolution::forge::{Checkout, GitAuth, GitSettings};
use quantmesh_testkit::git_http::{self, git};
use std::path::Path;

const TOKEN: &str = "qm-test-token-7f3a9c2e51";
const USER: &str = "x-access-token";

/// Every file under `dir` that holds `needle`.
fn files_holding(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_holding(&p, needle));
        } else if std::fs::read(&p)
            .unwrap()
            .windows(needle.len())
            .any(|w| w == needle)
        {
            out.push(p.display().to_string());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evolve_pushes_to_a_remote_that_requires_a_token_from_the_environment() {
    let tmp = tempfile::tempdir().unwrap();
    let repos = tmp.path().join("repos");
    std::fs::create_dir_all(&repos).unwrap();
    git_http::plan_repo(&repos, "{\"schema_version\": 1}\n");
    let server = git_http::start(&repos, USER, TOKEN).await;
    let var = format!("QM_TEST_GIT_TOKEN_{}", std::process::id());
    let settings = |checkout: &str| GitSettings {
        remote: server.url("plans.git"),
        checkout: tmp.path().join(checkout),
        token_env: var.clone(),
        ..GitSettings::default()
    };

    // Without the token the server refuses, and git does not wait for a prompt.
    let s = settings("without");
    let open = tokio::task::spawn_blocking(move || Checkout::open(&s).map(|_| ()))
        .await
        .unwrap();
    let err = open
        .expect_err("a clone without credentials succeeded")
        .to_string();
    // git asked for credentials (the server's 401) and, with none to give, stopped.
    assert!(
        err.contains("could not read Username") || err.to_lowercase().contains("authentication"),
        "{err}"
    );
    assert!(
        server
            .auth_seen
            .lock()
            .unwrap()
            .iter()
            .all(String::is_empty),
        "credentials were sent without a token"
    );

    // With the token in the environment, as a Secret's env var provides it.
    std::env::set_var(&var, TOKEN);
    let auth = GitAuth::from_settings(&settings("with")).unwrap();
    assert!(auth.has_token());
    for (k, v) in auth.env() {
        assert!(!v.contains(TOKEN) && !k.contains(TOKEN), "{k}={v}");
    }
    assert!(
        auth.env()
            .iter()
            .any(|(_, v)| v.contains(&format!("${var}"))),
        "the helper reads the variable: {:?}",
        auth.env()
    );
    let s = settings("with");
    let pushed = tokio::task::spawn_blocking(move || {
        let checkout = Checkout::open(&s)?;
        checkout.push(
            "smollm2",
            b"{\"schema_version\": 1, \"groups\": {}}\n",
            "evolve: test",
        )
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(pushed.1, Some(true), "{pushed:?}");
    let branches = git(&repos.join("plans.git"), &["branch", "--list"]);
    assert!(branches.contains(&pushed.0), "{branches}");
    // The server saw the token, so the push went through its check.
    let seen = server.auth_seen.lock().unwrap().clone();
    assert!(
        seen.iter().any(|a| a == &git_http::basic(USER, TOKEN)),
        "no request carried the token: {seen:?}"
    );
    // It is in no file of the working clone (its config, its remote URL, its logs).
    let leaked = files_holding(&tmp.path().join("with"), TOKEN.as_bytes());
    assert!(leaked.is_empty(), "the token was written to {leaked:?}");

    // A wrong token is refused, and the error does not show the token.
    std::env::set_var(&var, "wrong-token-5d1e");
    let s = settings("wrong");
    let err = tokio::task::spawn_blocking(move || Checkout::open(&s).map(|_| ()))
        .await
        .unwrap()
        .expect_err("a wrong token was accepted")
        .to_string();
    assert!(
        !err.contains("wrong-token-5d1e") && !err.contains(TOKEN),
        "{err}"
    );
    std::env::remove_var(&var);
}

#[test]
fn the_credential_settings_are_checked() {
    let bad_var = GitSettings {
        token_env: "TOKEN; rm -rf /".into(),
        ..GitSettings::default()
    };
    assert!(GitAuth::from_settings(&bad_var).is_err());
    let bad_user = GitSettings {
        username: "a b".into(),
        ..GitSettings::default()
    };
    assert!(GitAuth::from_settings(&bad_user).is_err());
    // Unset variable: no helper, git's own credentials.
    let unset = GitSettings {
        token_env: "QM_TEST_GIT_TOKEN_NEVER_SET".into(),
        ..GitSettings::default()
    };
    assert!(!GitAuth::from_settings(&unset).unwrap().has_token());
}
