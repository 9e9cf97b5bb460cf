#!/usr/bin/env python3
"""Write quantmesh's Grafana dashboards (dashboards/*.json) from the panel lists below.

    python3 dashboards/generate.py          # (re)write the JSON files
    python3 dashboards/generate.py --check  # exit 1 if a file differs from what this writes

The JSON is committed so Grafana can provision it as is (dashboards/provisioning/); the suite
runs --check and evaluates every query against a real Prometheus scraping a real server
(services/quantmesh/tests/observability.rs). Standard library only.
"""
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance"'
W = "$__rate_interval"


def q(expr, legend=""):
    return {"expr": expr, "legendFormat": legend}


def quantiles(metric, what):
    return [
        q(f'histogram_quantile({p}, sum by (le) (rate({metric}_bucket{{{SEL}}}[{W}])))', f"{what} p{int(p * 100)}")
        for p in (0.5, 0.9, 0.99)
    ]


def panel(title, targets, unit="short", kind="timeseries", desc="", stack=False):
    p = {
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": DS,
        "targets": [dict(t, refId=chr(ord("A") + i), datasource=DS) for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
    }
    if kind == "timeseries" and stack:
        p["fieldConfig"]["defaults"]["custom"] = {"stacking": {"mode": "normal"}}
    return p


def dashboard(uid, title, desc, panels):
    placed = []
    for i, p in enumerate(panels):
        p = dict(p, id=i + 1, gridPos={"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)})
        placed.append(p)
    return {
        "uid": uid,
        "title": title,
        "description": desc,
        "tags": ["quantmesh"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "links": [{"type": "dashboards", "tags": ["quantmesh"], "asDropdown": True, "title": "quantmesh"}],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
             "current": {}, "hide": 0},
            {"name": "instance", "type": "query", "datasource": DS, "label": "instance",
             "query": {"query": "label_values(quantmesh_ready, instance)", "refId": "instance"},
             "definition": "label_values(quantmesh_ready, instance)",
             "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "refresh": 2, "hide": 0},
        ]},
        "annotations": {"list": [
            {"name": "config reloads", "datasource": DS, "enable": True, "iconColor": "blue",
             "expr": f'changes(quantmesh_config_applied_timestamp_seconds{{{SEL}}}[1m]) > 0',
             "titleFormat": "sensitive_layers.json applied"},
        ]},
        "panels": placed,
    }


OVERVIEW = dashboard("quantmesh-overview", "quantmesh / Overview",
    "Requests, latency (vLLM-compatible buckets), tokens, queue, errors.", [
    panel("Requests by status", [q(f'sum by (status) (rate(quantmesh_requests_total{{{SEL}}}[{W}]))', "{{status}}")], "reqps", stack=True),
    panel("Finished by reason", [q(f'sum by (finished_reason) (rate(quantmesh_request_success_total{{{SEL}}}[{W}]))', "{{finished_reason}}")], "reqps", stack=True),
    panel("4xx / 5xx share", [
        # `or vector(0)`: no 5xx series at all is a share of 0, not a gap.
        q(f'(sum(rate(quantmesh_requests_total{{{SEL},status=~"4.."}}[{W}])) or vector(0)) / sum(rate(quantmesh_requests_total{{{SEL}}}[{W}]))', "4xx"),
        q(f'(sum(rate(quantmesh_requests_total{{{SEL},status=~"5.."}}[{W}])) or vector(0)) / sum(rate(quantmesh_requests_total{{{SEL}}}[{W}]))', "5xx"),
    ], "percentunit"),
    panel("Time to first token", quantiles("quantmesh_time_to_first_token_seconds", "TTFT"), "s"),
    panel("Inter-token latency", quantiles("quantmesh_inter_token_latency_seconds", "ITL"), "s"),
    panel("End-to-end latency", quantiles("quantmesh_e2e_request_latency_seconds", "e2e"), "s"),
    panel("Tokens per second", [
        q(f'sum(rate(quantmesh_prompt_tokens_total{{{SEL}}}[{W}]))', "prompt"),
        q(f'sum(rate(quantmesh_generation_tokens_total{{{SEL}}}[{W}]))', "generated"),
    ], "short"),
    panel("Scheduler queue", [
        q(f'sum(quantmesh_num_requests_running{{{SEL}}})', "running"),
        q(f'sum(quantmesh_num_requests_waiting{{{SEL}}})', "waiting"),
    ]),
    panel("In flight and ready", [
        q(f'sum(quantmesh_http_requests_in_flight{{{SEL}}})', "in flight (admission permits)"),
        q(f'min(quantmesh_ready{{{SEL}}})', "ready (min over instances)"),
    ]),
    panel("Failed steps", [q(f'sum by (cause) (increase(quantmesh_engine_step_failures_total{{{SEL}}}[{W}]))', "{{cause}}")],
          desc="Contained panics and errors; each failed its step's requests with 500."),
])

PRECISION = dashboard("quantmesh-precision", "quantmesh / Precision",
    "Which groups run in float and why, the quality the monitor measures, and what it costs in memory.", [
    panel("Groups in fallback", [q(f'sum(quantmesh_monitor_groups_in_fallback{{{SEL}}})', "groups in float")]),
    panel("Outlier rate by group (last window)", [q(f'max by (group) (quantmesh_monitor_outlier_rate{{{SEL}}})', "{{group}}")],
          "percentunit", kind="heatmap",
          desc="Share of rows counted against the trigger per linear group: activation spikes beyond kσ and the material floor (8-bit activations only) and rows the quantized weights hurt beyond max_nsr; a group enters fallback above its trigger rate."),
    panel("Harm by group (last window)", [q(f'max by (group) (quantmesh_monitor_harm_nsr{{{SEL}}})', "{{group}}")],
          "none", kind="heatmap",
          desc="Mean output noise-to-signal ratio the group's quantized weights gave its rows (the harm test's statistic; 8-bit groups sit near 1e-5, 4-bit ones near 1e-2; a row above engine.monitor.max_nsr counts as an outlier)."),
    panel("Decisions by granularity and reason", [
        q(f'sum by (granularity, reason, action) (rate(quantmesh_fallback_decisions_total{{{SEL}}}[{W}]))', "{{granularity}} {{reason}} {{action}}")],
          "ops", stack=True),
    panel("Rows on the float path", [
        q(f'sum(rate(quantmesh_linear_rows_total{{{SEL},path="float"}}[{W}])) / sum(rate(quantmesh_linear_rows_total{{{SEL}}}[{W}]))', "float share"),
        q(f'sum(rate(quantmesh_fallback_unavailable_rows_total{{{SEL}}}[{W}]))', "wanted float, INT8-only (rows/s)"),
    ], "percentunit"),
    panel("Shadow KL (sampled)", [
        q(f'histogram_quantile(0.5, sum by (le) (rate(quantmesh_shadow_kl_bucket{{{SEL}}}[{W}])))', "p50"),
        q(f'histogram_quantile(0.95, sum by (le) (rate(quantmesh_shadow_kl_bucket{{{SEL}}}[{W}])))', "p95"),
    ], "short", desc="KL(P_float ‖ P_served) in nats on sampled rows."),
    panel("Resident weights by form", [q(f'sum by (form) (quantmesh_weight_bytes{{{SEL}}})', "{{form}}")], "bytes", stack=True),
    panel("Weights vs all-f16", [q(f'max(quantmesh_weight_f16_ratio{{{SEL}}})', "× all-f16")], "short"),
    panel("Plan in force (md5)", [q(f'max by (instance, md5) (quantmesh_config_info{{{SEL}}})', "{{instance}} {{md5}}")], kind="table"),
    panel("Reloads by result", [q(f'sum by (result) (increase(quantmesh_config_reloads_total{{{SEL}}}[{W}]))', "{{result}}")], stack=True),
    panel("Time since the plan was applied", [q(f'time() - max(quantmesh_config_applied_timestamp_seconds{{{SEL}}})', "age")], "s"),
])

KV = dashboard("quantmesh-kv-cache", "quantmesh / KV cache",
    "Paged KV cache: pages, fragmentation, prefix cache, admission waits.", [
    panel("Pages", [
        q(f'sum(quantmesh_kv_cache_pages_used{{{SEL}}})', "used"),
        q(f'sum(quantmesh_kv_cache_pages_free{{{SEL}}})', "free"),
    ], stack=True),
    panel("Usage", [q(f'max(quantmesh_kv_cache_usage_perc{{{SEL}}})', "usage")], "percentunit"),
    panel("Fragmentation", [q(f'max(quantmesh_kv_cache_fragmentation_ratio{{{SEL}}})', "unused share of allocated pages")], "percentunit"),
    panel("Prefix cache hit rate", [
        q(f'sum(rate(quantmesh_prefix_cache_hits_total{{{SEL}}}[{W}])) / sum(rate(quantmesh_prefix_cache_queries_total{{{SEL}}}[{W}]))', "tokens hit / looked up"),
    ], "percentunit", desc="As vLLM's prefix_cache_hits / prefix_cache_queries (tokens)."),
    panel("Prefix cache pages reused", [q(f'sum(rate(quantmesh_prefix_cache_hit_pages_total{{{SEL}}}[{W}]))', "pages/s")]),
    panel("Waiting for admission", [q(f'sum(quantmesh_num_requests_waiting{{{SEL}}})', "waiting")],
          desc="Requests queued because their pages do not fit yet (no preemption: admission reserves the worst case)."),
    panel("Steps", [q(f'sum(rate(quantmesh_engine_steps_total{{{SEL}}}[{W}]))', "steps/s")], "ops"),
])

EVENTS = dashboard("quantmesh-event-path", "quantmesh / Event path",
    "Fallback and config events: durable outbox, relay to Kafka, drops; trace export.", [
    panel("Outbox depth", [q(f'sum(quantmesh_events_outbox_depth{{{SEL}}})', "events waiting")]),
    panel("Outbox fill", [q(f'max(quantmesh_events_outbox_bytes{{{SEL}}} / quantmesh_events_outbox_max_bytes{{{SEL}}})', "bytes / bound")], "percentunit"),
    panel("Recorded and delivered", [
        q(f'sum by (event_type) (rate(quantmesh_events_recorded_total{{{SEL}}}[{W}]))', "recorded {{event_type}}"),
        q(f'sum by (event_type) (rate(quantmesh_events_delivered_total{{{SEL}}}[{W}]))', "delivered {{event_type}}"),
    ], "ops"),
    panel("Relay lag (p99)", [q(f'histogram_quantile(0.99, sum by (le) (rate(quantmesh_events_delivery_latency_seconds_bucket{{{SEL}}}[{W}])))', "stored → acknowledged")], "s"),
    panel("Drops by reason", [q(f'sum by (reason) (increase(quantmesh_events_dropped_total{{{SEL}}}[{W}]))', "{{reason}}")], stack=True),
    panel("Broker", [
        q(f'min(quantmesh_kafka_broker_up{{{SEL}}})', "broker up"),
        q(f'sum(rate(quantmesh_events_delivery_failures_total{{{SEL}}}[{W}]))', "failed deliveries/s"),
        q(f'sum(increase(quantmesh_kafka_producer_restarts_total{{{SEL}}}[{W}]))', "producer restarts"),
    ]),
    panel("Trace export (OTLP)", [q(f'sum by (outcome) (rate(quantmesh_otel_spans_total{{{SEL}}}[{W}]))', "spans {{outcome}}")], "ops",
          desc="Spans handed to the OTLP exporter: exported, or failed (collector unreachable or refusing; the batch is dropped, serving is unaffected). Zero when traces are off."),
])

FILES = {
    "quantmesh-overview.json": OVERVIEW,
    "quantmesh-precision.json": PRECISION,
    "quantmesh-kv-cache.json": KV,
    "quantmesh-event-path.json": EVENTS,
}


def main():
    check = "--check" in sys.argv[1:]
    stale = []
    for name, d in FILES.items():
        text = json.dumps(d, indent=2, ensure_ascii=False) + "\n"
        path = HERE / name
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print("stale dashboards (run python3 dashboards/generate.py):", ", ".join(stale), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
