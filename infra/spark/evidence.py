#!/usr/bin/env python3
"""quantmesh's weekly evidence on Spark.

Runs the evidence queries of `quantmesh evolve` (services/evolution/sql/evidence.sql, the
same SQL text DataFusion runs) as Spark SQL over the same Parquet lake, and writes the rows
as an evidence file (shared/schemas/EVIDENCE.md). `quantmesh evolve --once --evidence FILE`
turns that file into the same proposal its own analysis would make.

    # local mode (PyPI pyspark, a Java 17+ runtime):
    python3 infra/spark/evidence.py --lake ./lake --model SmolLM2-135M-Instruct --out evidence.json
    # on a cluster (the lake on S3: s3a://bucket/lake, with hadoop-aws on the classpath):
    spark-submit --files services/evolution/sql/evidence.sql,infra/spark/lake-tables.json \\
        infra/spark/evidence.py --lake s3a://bucket/lake --model NAME --out evidence.json \\
        --queries evidence.sql --tables lake-tables.json
    quantmesh evolve --once --evidence evidence.json

Dates: --since/--until take RFC 3339 or YYYY-MM-DD (UTC); by default the last 7 days up to
now, like `quantmesh evolve`. --request-kl-limit must be the limit the plan in force uses
(its thresholds.request_kl_limit, else evolution.request_kl_limit, default 0.02):
`quantmesh evolve` refuses a file split by another limit.
"""

import argparse
import datetime
import json
import pathlib
import re
import sys

FORMAT = "quantmesh.evidence-tables.v1"
NAMES = ["groups", "decisions", "kl", "healthy", "windows", "configs"]
HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_QUERIES = HERE.parent.parent / "services" / "evolution" / "sql" / "evidence.sql"
DEFAULT_TABLES = HERE / "lake-tables.json"
# Spark's spelling of {ts_ms}: the Parquet column ts (a millisecond timestamp) in Unix ms.
SPARK_TS_MS = "unix_millis(ts)"


def model_partition(model):
    """The lake's partition value for a model name (the rule of `quantmesh evolve`)."""
    s = re.sub(r"[^A-Za-z0-9._-]", "_", model)
    return s or "_unknown"


def parse_queries(text):
    """[(name, sql)] of the query file: each query follows a `-- name: <name>` line."""
    out = []
    for line in text.splitlines():
        if line.startswith("-- name:"):
            out.append([line[len("-- name:"):].strip(), []])
        elif out:
            out[-1][1].append(line)
    queries = [(n, "\n".join(body).strip().rstrip(";").rstrip()) for n, body in out]
    names = [n for n, _ in queries]
    if names != NAMES:
        raise SystemExit(f"the query file names {names}; the evidence needs {NAMES}")
    for name, sql in queries:
        if not sql:
            raise SystemExit(f"query {name!r} is empty")
    return queries


def fill(sql, model, since_ms, until_ms, limit):
    filled = (
        sql.replace("{model}", "'" + model_partition(model).replace("'", "''") + "'")
        .replace("{since_ms}", str(since_ms))
        .replace("{until_ms}", str(until_ms))
        .replace("{ts_ms}", SPARK_TS_MS)
        .replace("{request_kl_limit}", repr(float(limit)))
    )
    if "{" in filled:
        at = filled.index("{")
        raise SystemExit(f"unknown placeholder at {filled[at:at + 24]!r}")
    return filled


def parse_time(s):
    """Unix ms of an RFC 3339 time or a YYYY-MM-DD date (UTC midnight)."""
    try:
        d = datetime.datetime.strptime(s, "%Y-%m-%d").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        try:
            d = datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            raise SystemExit(f"{s!r} is neither RFC 3339 nor YYYY-MM-DD")
        if d.tzinfo is None:
            raise SystemExit(f"{s!r} has no UTC offset")
    return int(d.timestamp() * 1000)


def load_table(spark, lake, name, ddl):
    """The table's `*.parquet` files read with the lake's own schema (`ddl`, from
    lake-tables.json, plus the model=…/date=… directories as strings), or an empty table of
    that schema when it has none yet. Exactly what `quantmesh evolve` reads with DataFusion:
    a leftover staging file (any other name) is not read, and a column a file has beyond the
    schema is not seen, so neither changes the answer (Spark alone would otherwise infer the
    schema from some file and read every file of the folder)."""
    from pyspark.errors import AnalysisException

    schema = ddl + ", model STRING, date STRING"
    path = lake.rstrip("/") + "/" + name
    try:
        return spark.read.schema(schema).option("pathGlobFilter", "*.parquet").parquet(path)
    except AnalysisException as e:
        if e.getCondition() not in ("PATH_NOT_FOUND", "UNABLE_TO_INFER_SCHEMA"):
            raise
        return spark.createDataFrame([], schema)


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Run quantmesh's weekly evidence queries on Spark and write the evidence "
        "file `quantmesh evolve --once --evidence FILE` reads.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--lake", required=True, help="the lake: a directory or a Hadoop URL (s3a://, hdfs://)")
    p.add_argument("--model", required=True, help="the served model's name, as in the events")
    p.add_argument("--out", required=True, help="the evidence file to write (JSON)")
    p.add_argument("--since", help="start of the span [default: until - 7 days]")
    p.add_argument("--until", help="end of the span, exclusive [default: now]")
    p.add_argument("--request-kl-limit", type=float, default=0.02,
                   help="the per-request KL limit in force [default: 0.02]")
    p.add_argument("--queries", default=str(DEFAULT_QUERIES), help="the evidence queries (SQL)")
    p.add_argument("--tables", default=str(DEFAULT_TABLES), help="the lake's table schemas (JSON)")
    p.add_argument("--master", help="Spark master [default: spark-submit's, else local[*]]")
    a = p.parse_args(argv)

    until_ms = parse_time(a.until) if a.until else int(datetime.datetime.now(datetime.timezone.utc).timestamp() * 1000)
    since_ms = parse_time(a.since) if a.since else until_ms - 7 * 24 * 3600 * 1000
    if since_ms >= until_ms:
        raise SystemExit(f"--since ({since_ms} ms) is not before --until ({until_ms} ms)")
    if not (a.request_kl_limit > 0 and a.request_kl_limit != float("inf")):
        raise SystemExit("--request-kl-limit must be a positive number")
    queries = parse_queries(pathlib.Path(a.queries).read_text())
    tables = json.loads(pathlib.Path(a.tables).read_text())

    from pyspark.sql import SparkSession

    b = (
        SparkSession.builder.appName("quantmesh-evidence")
        .config("spark.sql.ansi.enabled", "true")
        .config("spark.sql.ansi.doubleQuotedIdentifiers", "true")
        # model=… and date=… stay strings (a date-like value would become a DATE).
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
    )
    if a.master:
        b = b.master(a.master)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    try:
        for name, ddl in tables.items():
            load_table(spark, a.lake, name, ddl).createOrReplaceTempView(name)
        out_tables = {}
        for name, sql in queries:
            rows = spark.sql(fill(sql, a.model, since_ms, until_ms, a.request_kl_limit)).collect()
            out_tables[name] = [r.asDict() for r in rows]
        doc = {
            "format": FORMAT,
            "engine": f"spark {spark.version}",
            "model": a.model,
            "since_ms": since_ms,
            "until_ms": until_ms,
            "request_kl_limit": a.request_kl_limit,
            "tables": out_tables,
        }
    finally:
        spark.stop()
    text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    pathlib.Path(a.out).write_text(text)
    counts = ", ".join(f"{n} {len(out_tables[n])}" for n in NAMES)
    print(f"evidence for {a.model} [{since_ms}, {until_ms}) written to {a.out} ({counts} rows)", file=sys.stderr)


if __name__ == "__main__":
    main()
