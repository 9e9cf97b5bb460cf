-- quantmesh's weekly evidence: the queries every engine runs over the Parquet lake.
--
-- The same text runs on DataFusion (`quantmesh evolve`) and on Spark SQL
-- (`infra/spark/evidence.py`); each engine fills in the placeholders and returns the rows
-- as they are, and `quantmesh evolve` turns the rows into the evidence its rules read.
-- Keep the text portable:
--   * identifiers in double quotes ("group"); Spark runs with
--     spark.sql.ansi.doubleQuotedIdentifiers=true;
--   * percentiles are nearest-rank (exact: the smallest value with at least p of the values
--     at or below it; ROW_NUMBER against CEIL(p * n) in double precision), so every engine
--     gives the same number; no engine's approximate percentile;
--   * NULL ordering is spelled out (engines' defaults differ); rows tied in a percentile's
--     order have the same value, so their order cannot change the result; the newest
--     window's residency is the greatest among the windows at the newest ts;
--   * rows are deduplicated on the event's columns (SELECT DISTINCT), since the lake is
--     at-least-once at the source and a redelivered event must not count twice.
--
-- Placeholders:
--   {model}             the model's partition value, as an SQL string literal
--   {since_ms}          start of the span, Unix milliseconds (inclusive)
--   {until_ms}          end of the span, Unix milliseconds (exclusive)
--   {ts_ms}             the engine's expression for column ts in Unix milliseconds
--                       (DataFusion: CAST(ts AS BIGINT); Spark: unix_millis(ts))
--   {request_kl_limit}  the per-request KL limit in force (splits healthy samples)
--
-- Each query starts at a line `-- name: <name>`; its rows are the evidence table <name>.

-- name: groups
WITH w AS (
    SELECT DISTINCT event_id, "group", ts, tokens, outliers, outlier_rate,
           in_float, wanted_unavailable, residency, mean_nsr
    FROM window_groups
    WHERE model = {model} AND {ts_ms} >= {since_ms} AND {ts_ms} < {until_ms}
), ranked AS (
    SELECT "group", tokens, outliers, outlier_rate, in_float, wanted_unavailable, residency,
           mean_nsr,
           ROW_NUMBER() OVER (PARTITION BY "group" ORDER BY outlier_rate ASC NULLS LAST) AS rate_rank,
           COUNT(outlier_rate) OVER (PARTITION BY "group") AS rated,
           ts = MAX(ts) OVER (PARTITION BY "group") AS newest
    FROM w
)
SELECT "group",
       COUNT(*) AS windows,
       SUM(tokens) AS tokens,
       SUM(outliers) AS outliers,
       MIN(CASE WHEN rate_rank >= CEIL(CAST(0.5 AS DOUBLE) * rated) THEN outlier_rate END) AS rate_p50,
       MIN(CASE WHEN rate_rank >= CEIL(CAST(0.95 AS DOUBLE) * rated) THEN outlier_rate END) AS rate_p95,
       MAX(outlier_rate) AS rate_max,
       SUM(CASE WHEN in_float THEN 1 ELSE 0 END) AS float_windows,
       SUM(CASE WHEN wanted_unavailable THEN 1 ELSE 0 END) AS unavailable_windows,
       MAX(CASE WHEN newest THEN residency END) AS residency,
       SUM(CASE WHEN mean_nsr IS NOT NULL THEN mean_nsr * CAST(tokens AS DOUBLE) END)
           / NULLIF(SUM(CASE WHEN mean_nsr IS NOT NULL THEN CAST(tokens AS DOUBLE) END), 0)
           AS served_nsr
FROM ranked
GROUP BY "group"
ORDER BY "group" ASC

-- name: decisions
SELECT "group", granularity, reason, action, COUNT(*) AS n
FROM (SELECT DISTINCT event_id, "group", granularity, reason, action
      FROM fallback_events
      WHERE model = {model} AND {ts_ms} >= {since_ms} AND {ts_ms} < {until_ms}) AS d
GROUP BY "group", granularity, reason, action
ORDER BY "group" ASC NULLS FIRST, granularity ASC, reason ASC, action ASC

-- name: kl
WITH s AS (
    SELECT DISTINCT event_id, sample, kl, kl_reference
    FROM shadow_kl
    WHERE model = {model} AND {ts_ms} >= {since_ms} AND {ts_ms} < {until_ms}
), ranked AS (
    SELECT kl, kl_reference,
           ROW_NUMBER() OVER (ORDER BY kl ASC) AS k,
           COUNT(*) OVER () AS n
    FROM s
)
SELECT COUNT(*) AS n,
       MIN(CASE WHEN k >= CEIL(CAST(0.5 AS DOUBLE) * n) THEN kl END) AS p50,
       MIN(CASE WHEN k >= CEIL(CAST(0.9 AS DOUBLE) * n) THEN kl END) AS p90,
       MIN(CASE WHEN k >= CEIL(CAST(0.99 AS DOUBLE) * n) THEN kl END) AS p99,
       MAX(kl) AS max,
       SUM(CASE WHEN kl <= CAST({request_kl_limit} AS DOUBLE) THEN 1 ELSE 0 END) AS healthy,
       SUM(CASE WHEN kl_reference = 'partial_float_weights' THEN 1 ELSE 0 END) AS partial
FROM ranked

-- name: healthy
WITH s AS (
    SELECT DISTINCT event_id, sample, kl
    FROM shadow_kl
    WHERE model = {model} AND {ts_ms} >= {since_ms} AND {ts_ms} < {until_ms}
      AND kl <= CAST({request_kl_limit} AS DOUBLE)
), ranked AS (
    SELECT kl,
           ROW_NUMBER() OVER (ORDER BY kl ASC) AS k,
           COUNT(*) OVER () AS n
    FROM s
)
SELECT MIN(CASE WHEN k >= CEIL(CAST(0.99 AS DOUBLE) * n) THEN kl END) AS p99
FROM ranked

-- name: windows
SELECT COUNT(*) AS n,
       SUM(request_kl_fallbacks) AS request_kl,
       MAX({ts_ms}) AS last_ms
FROM (SELECT DISTINCT event_id, request_kl_fallbacks, ts
      FROM windows
      WHERE model = {model} AND {ts_ms} >= {since_ms} AND {ts_ms} < {until_ms}) AS w

-- name: configs
SELECT SUM(CASE WHEN action = 'applied' THEN 1 ELSE 0 END) AS applied,
       SUM(CASE WHEN action <> 'applied' THEN 1 ELSE 0 END) AS rejected
FROM (SELECT DISTINCT event_id, action
      FROM config_events
      WHERE model = {model} AND {ts_ms} >= {since_ms} AND {ts_ms} < {until_ms}) AS c
