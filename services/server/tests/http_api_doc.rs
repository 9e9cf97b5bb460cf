//! The HTTP API page's route reference is generated from the server's own OpenAPI document
//! (what `GET /openapi.json` answers): `QUANTMESH_UPDATE_DOCS=1 cargo test -p
//! quantmesh-server --test http_api_doc` rewrites it, and the suite fails when it is stale.

use quantmesh_server::openapi::document;
use serde_json::Value;
use std::path::PathBuf;

const BEGIN: &str = "<!-- routes: generated from /openapi.json; do not edit -->\n";
const END: &str = "<!-- end of routes -->";

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// A schema in a few words: its type, or the name it refers to.
fn type_of(s: &Value) -> String {
    if let Some(r) = s["$ref"].as_str() {
        return r.rsplit('/').next().unwrap_or(r).to_string();
    }
    if let Some(any) = s["anyOf"].as_array().or(s["oneOf"].as_array()) {
        let parts: Vec<String> = any.iter().map(type_of).filter(|t| t != "null").collect();
        return parts.join(" or ");
    }
    match &s["type"] {
        Value::String(t) if t == "array" => format!("array of {}", type_of(&s["items"])),
        Value::String(t) => t.clone(),
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .filter(|t| *t != "null")
            .collect::<Vec<_>>()
            .join(" or "),
        _ if s["enum"].is_array() => "string".to_string(),
        _ => "any".to_string(),
    }
}

/// Range and choice facts a schema states (`minimum`, `maximum`, `enum`).
fn limits(s: &Value) -> String {
    let mut out = Vec::new();
    if let Some(v) = s.get("minimum") {
        out.push(format!("≥ {v}"));
    }
    if let Some(v) = s.get("exclusiveMinimum") {
        out.push(format!("> {v}"));
    }
    if let Some(v) = s.get("maximum") {
        out.push(format!("≤ {v}"));
    }
    if let Some(e) = s["enum"].as_array() {
        let vs: Vec<String> = e.iter().map(|v| format!("`{v}`")).collect();
        out.push(format!("one of {}", vs.join(", ")));
    }
    out.join(", ")
}

fn render(doc: &Value) -> String {
    let schemas = &doc["components"]["schemas"];
    let mut out = String::new();
    let Some(paths) = doc["paths"].as_object() else {
        panic!("no paths in {doc}")
    };
    for (path, item) in paths {
        let Some(ops) = item.as_object() else {
            continue;
        };
        for (method, op) in ops {
            out.push_str(&format!("### `{} {path}`\n\n", method.to_uppercase()));
            out.push_str(op["summary"].as_str().unwrap_or(""));
            match op["security"][0].as_object().and_then(|o| o.keys().next()) {
                Some(s) if s == "api_key" => {
                    out.push_str(" Needs an API key when `server.api_keys` is set.")
                }
                Some(s) if s == "admin_token" => {
                    out.push_str(" Needs the admin token (`QUANTMESH_ADMIN_TOKEN`).")
                }
                _ => {}
            }
            out.push_str("\n\n");
            let body = &op["requestBody"]["content"]["application/json"]["schema"];
            if !body.is_null() {
                let name = type_of(body);
                let schema = if body["$ref"].is_string() {
                    &schemas[&name]
                } else {
                    body
                };
                if let Some(props) = schema["properties"].as_object() {
                    let required: Vec<&str> = schema["required"]
                        .as_array()
                        .map(|r| r.iter().filter_map(Value::as_str).collect())
                        .unwrap_or_default();
                    out.push_str(&format!(
                        "Body (`{name}`; a field not listed is refused with 400):\n\n| field | type | limits | what it is |\n|---|---|---|---|\n"
                    ));
                    for (field, s) in props {
                        let req = if required.contains(&field.as_str()) {
                            " (required)"
                        } else {
                            ""
                        };
                        out.push_str(&format!(
                            "| `{field}`{req} | {} | {} | {} |\n",
                            cell(&type_of(s)),
                            cell(&limits(s)),
                            cell(s["description"].as_str().unwrap_or(""))
                        ));
                    }
                    out.push('\n');
                }
            }
            if let Some(responses) = op["responses"].as_object() {
                out.push_str("| status | when |\n|---|---|\n");
                for (status, r) in responses {
                    let mut why = r["description"].as_str().unwrap_or("").to_string();
                    if let Some(content) = r["content"].as_object() {
                        let kinds: Vec<&str> = content.keys().map(String::as_str).collect();
                        if status == "200" {
                            why = format!("{why} ({})", kinds.join(" or "));
                        }
                    }
                    out.push_str(&format!("| {status} | {} |\n", cell(&why)));
                }
                out.push('\n');
            }
        }
    }
    out
}

#[test]
fn the_http_api_page_is_generated_from_the_openapi_document() {
    let doc = document(true, true);
    let routes = render(&doc);
    assert!(
        routes.contains("### `POST /v1/chat/completions`") && routes.contains("`temperature`"),
        "{routes}"
    );
    quantmesh_testkit::generated::keep_block_current(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/http-api.md"),
        BEGIN,
        END,
        &routes,
        "cargo test -p quantmesh-server --test http_api_doc",
    );
}
