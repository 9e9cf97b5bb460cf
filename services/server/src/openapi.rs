//! The OpenAPI 3.1 document of the gateway's routes, served at `GET /openapi.json`.
//!
//! Request and response bodies are JSON Schemas (2020-12, the dialect OpenAPI 3.1 uses)
//! generated with `schemars` from the very types the handlers deserialize and serialize
//! (`openai.rs`), so the contract cannot drift from the code; the route table below states
//! paths, methods, status codes and security. `services/quantmesh/tests/openapi.rs` runs
//! schemathesis against a live server with this document.

use crate::openai::{
    ChatCompletionResponse, ChatRequest, CompletionRequest, CompletionResponse, ErrorBody,
    HealthBody, ModelList, ReadyBody,
};
use schemars::generate::{SchemaGenerator, SchemaSettings};
use schemars::JsonSchema;
use serde_json::{json, Map, Value};

/// Who may call a route.
#[derive(Clone, Copy, PartialEq)]
enum Access {
    Public,
    /// `Authorization: Bearer <api key>` when API keys are configured.
    ApiKey,
    /// `Authorization: Bearer <admin token>`; 403 when no admin token is configured.
    Admin,
}

/// What a route answers with 200.
enum Body {
    Schema(Value),
    /// Free-form JSON (admin views whose shape follows the engine's reports).
    AnyJson,
    Text(&'static str),
    /// JSON, or server-sent events when the request says `stream: true`.
    JsonOrEvents(Value),
}

struct Route {
    path: &'static str,
    method: &'static str,
    summary: &'static str,
    access: Access,
    request: Option<Value>,
    ok: Body,
    /// Error statuses this route may answer besides auth's, each with an [`ErrorBody`].
    errors: &'static [(&'static str, &'static str)],
}

const GENERATION_ERRORS: &[(&str, &str)] = &[
    (
        "400",
        "invalid or unsupported request (the field is named in `error.param`)",
    ),
    ("404", "unknown model"),
    ("413", "body over `max_body_bytes`"),
    ("422", "a field of the wrong type, or a missing one"),
    ("429", "`max_concurrent_requests` in flight"),
    ("500", "the engine failed this request"),
    ("503", "the model is loading, or the server is stopping"),
];

const ADMIN_ERRORS: &[(&str, &str)] = &[
    ("400", "invalid request"),
    ("422", "a field of the wrong type, or a missing one"),
    ("503", "the model is loading"),
];

/// The methods the document lists for `path` (upper case), `None` for a path it does not
/// list: what a 405's `Allow` header says.
pub fn allowed_methods(path: &str) -> Option<&'static [String]> {
    static TABLE: std::sync::OnceLock<std::collections::HashMap<String, Vec<String>>> =
        std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let doc = document(false, false);
        doc["paths"]
            .as_object()
            .map(|paths| {
                paths
                    .iter()
                    .map(|(p, item)| {
                        let methods = item
                            .as_object()
                            .map(|ops| ops.keys().map(|m| m.to_uppercase()).collect())
                            .unwrap_or_default();
                        (p.clone(), methods)
                    })
                    .collect()
            })
            .unwrap_or_default()
    });
    table.get(path).map(Vec::as_slice)
}

/// A `$ref` to `T`'s schema (added to the generator's definitions).
fn of<T: JsonSchema>(g: &mut SchemaGenerator) -> Value {
    g.subschema_for::<T>().to_value()
}

/// The document. `api_keys`: whether `/v1` routes need a key; `admin`: whether the admin
/// routes are enabled (with a token).
pub fn document(api_keys: bool, admin: bool) -> Value {
    let mut gen = SchemaGenerator::new(SchemaSettings::draft2020_12().with(|s| {
        s.definitions_path = "/components/schemas".into();
        s.meta_schema = None;
    }));
    let error = of::<ErrorBody>(&mut gen);
    let routes = [
        Route {
            path: "/health",
            method: "get",
            summary: "Liveness: the process answers.",
            access: Access::Public,
            request: None,
            ok: Body::Schema(of::<HealthBody>(&mut gen)),
            errors: &[],
        },
        Route {
            path: "/ready",
            method: "get",
            summary: "Readiness: the model is loaded and every engine actor is running.",
            access: Access::Public,
            request: None,
            ok: Body::Schema(of::<ReadyBody>(&mut gen)),
            errors: &[("503", "loading, stopping, or an engine actor has stopped")],
        },
        Route {
            path: "/metrics",
            method: "get",
            summary: "Prometheus text exposition.",
            access: Access::Public,
            request: None,
            ok: Body::Text("text/plain"),
            errors: &[],
        },
        Route {
            path: "/runbooks",
            method: "get",
            summary: "The runbook of every alert (HTML; each alert's section is anchored by its lower-cased name, where the alert rules' runbook_url points).",
            access: Access::Public,
            request: None,
            ok: Body::Text("text/html"),
            errors: &[],
        },
        Route {
            path: "/openapi.json",
            method: "get",
            summary: "This document.",
            access: Access::Public,
            request: None,
            ok: Body::AnyJson,
            errors: &[],
        },
        Route {
            path: "/v1/models",
            method: "get",
            summary: "The served model.",
            access: Access::ApiKey,
            request: None,
            ok: Body::Schema(of::<ModelList>(&mut gen)),
            errors: &[],
        },
        Route {
            path: "/v1/completions",
            method: "post",
            summary: "Complete a prompt (OpenAI completions).",
            access: Access::ApiKey,
            request: Some(of::<CompletionRequest>(&mut gen)),
            ok: Body::JsonOrEvents(of::<CompletionResponse>(&mut gen)),
            errors: GENERATION_ERRORS,
        },
        Route {
            path: "/v1/chat/completions",
            method: "post",
            summary: "Answer chat messages (OpenAI chat completions).",
            access: Access::ApiKey,
            request: Some(of::<ChatRequest>(&mut gen)),
            ok: Body::JsonOrEvents(of::<ChatCompletionResponse>(&mut gen)),
            errors: GENERATION_ERRORS,
        },
        Route {
            path: "/admin/mask",
            method: "get",
            summary: "The precision mask in force: groups, KV layers, requests in float.",
            access: Access::Admin,
            request: None,
            ok: Body::AnyJson,
            errors: ADMIN_ERRORS,
        },
        Route {
            path: "/admin/fallback",
            method: "get",
            summary: "Every group's monitor state.",
            access: Access::Admin,
            request: None,
            ok: Body::AnyJson,
            errors: ADMIN_ERRORS,
        },
        Route {
            path: "/admin/fallback",
            method: "post",
            summary: "Force a group to float or INT8, or hand it back to the monitor; answers the ids of the fallback events the decision made (`event_ids`, as on the event stream).",
            access: Access::Admin,
            request: Some(json!({
                "type": "object",
                "additionalProperties": false,
                "required": ["group", "mode"],
                "properties": {
                    "group": {"type": "string", "pattern": "^layers\\.[0-9]+\\.(qkv|o|gate_up|down)$",
                              "description": "Like `layers.1.down`."},
                    "mode": {"enum": ["float", "int8", "auto"]}
                }
            })),
            ok: Body::AnyJson,
            errors: ADMIN_ERRORS,
        },
        Route {
            path: "/admin/config",
            method: "get",
            summary: "Hot-reload state: source, md5 in force, thresholds, residencies.",
            access: Access::Admin,
            request: None,
            ok: Body::AnyJson,
            errors: ADMIN_ERRORS,
        },
        Route {
            path: "/admin/config/reload",
            method: "post",
            summary: "Reload sensitive_layers.json now (the old plan stays when the new one is rejected).",
            access: Access::Admin,
            request: None,
            ok: Body::AnyJson,
            errors: &[
                ("400", "no `sensitive_layers` source is configured"),
                ("409", "a reload is settling or in progress"),
                ("422", "the new plan was rejected; the old one stays"),
                ("500", "valid, but could not be applied; rolled back"),
                ("502", "the plan's source could not be read"),
                ("503", "the model is loading"),
            ],
        },
    ];

    let mut paths = Map::new();
    for r in routes {
        let mut responses = Map::new();
        let ok = match r.ok {
            Body::Schema(s) => json!({"application/json": {"schema": s}}),
            Body::AnyJson => json!({"application/json": {"schema": {}}}),
            Body::Text(ct) => json!({ ct: {"schema": {"type": "string"}} }),
            Body::JsonOrEvents(s) => json!({
                "application/json": {"schema": s},
                "text/event-stream": {"schema": {
                    "description": "One event per chunk: `data: <chunk JSON>` (the answer's shape with \
                                    `delta` for `message`), a usage chunk when asked for, then `data: [DONE]`",
                    "type": "object",
                    "required": ["data"],
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}
                }}
            }),
        };
        responses.insert("200".into(), json!({"description": "OK", "content": ok}));
        let mut errors: Vec<(&str, &str)> = r.errors.to_vec();
        match r.access {
            Access::Public => {}
            Access::ApiKey if api_keys => {
                errors.push(("401", "missing or invalid API key"));
            }
            Access::ApiKey => {}
            Access::Admin => {
                errors.push(("401", "missing or wrong admin token"));
                errors.push(("403", "admin routes are disabled (no admin token set)"));
            }
        }
        if r.request.is_some() {
            errors.push(("400", "malformed JSON"));
            errors.push(("413", "body over `max_body_bytes`"));
            errors.push(("422", "a field of the wrong type, or a missing one"));
        }
        for (status, why) in errors {
            let entry = responses.entry(status.to_string()).or_insert_with(|| {
                json!({"description": why, "content": {"application/json": {"schema": error.clone()}}})
            });
            if entry["description"].as_str() != Some(why) {
                let d = format!("{}; {why}", entry["description"].as_str().unwrap_or(""));
                entry["description"] = Value::String(d);
            }
        }
        let mut op = json!({
            "summary": r.summary,
            "operationId": format!("{}{}", r.method, r.path.replace(['/', '.'], "_")),
            "responses": responses,
        });
        if let Some(req) = r.request {
            op["requestBody"] =
                json!({"required": true, "content": {"application/json": {"schema": req}}});
        }
        match r.access {
            Access::ApiKey if api_keys => op["security"] = json!([{"api_key": []}]),
            Access::Admin if admin => op["security"] = json!([{"admin_token": []}]),
            _ => {}
        }
        let item = paths.entry(r.path.to_string()).or_insert_with(|| json!({}));
        item[r.method] = op;
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "quantmesh",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "OpenAI-compatible serving of INT8 models with online fallback to float. \
                            Request fields not in these schemas are refused with 400, never ignored."
        },
        "paths": paths,
        "components": {
            "schemas": gen.take_definitions(true),
            "securitySchemes": {
                "api_key": {"type": "http", "scheme": "bearer", "description": "One of `server.api_keys`."},
                "admin_token": {"type": "http", "scheme": "bearer", "description": "`QUANTMESH_ADMIN_TOKEN`."}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn every_reference_resolves_and_requests_refuse_unknown_fields() {
        let doc = document(true, true);
        assert_eq!(doc["openapi"], "3.1.0");
        let text = doc.to_string();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        for part in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
            let name = &part[..part.find('"').unwrap()];
            assert!(schemas.contains_key(name), "unresolved $ref {name}");
        }
        for req in ["CompletionRequest", "ChatRequest"] {
            let s = &schemas[req];
            assert_eq!(s["additionalProperties"], false, "{req}: {s}");
            // The flattened sampling fields are part of the object itself.
            assert!(s["properties"]["temperature"].is_object(), "{req}: {s}");
        }
        let paths = doc["paths"].as_object().unwrap();
        assert!(paths.contains_key("/v1/chat/completions"));
        assert!(doc["paths"]["/v1/completions"]["post"]["responses"]["401"].is_object());
        let open = document(false, false);
        assert!(open["paths"]["/v1/completions"]["post"]["security"].is_null());
        assert!(open["paths"]["/v1/completions"]["post"]["responses"]["401"].is_null());
    }
}
