"""The operator-facing configs: alert rules and the Grafana dashboard parse, name only
metrics that `pin metrics serve` serves (the list comes from the exporter's own `describe()`), and
pass `promtool check rules` / `promtool test rules`. The dashboard's queries are also checked
panel by panel, labels included, against the read API's own registry too.

promtool comes from Debian's `prometheus` package; without it these tests FAIL, they never skip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from pin_pipelines.api.observe import ApiMetrics
from pin_pipelines.config import Settings
from pin_pipelines.metrics.collector import PinCollector, sources
from tests.support.promql import Report, check, served_series

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "ops" / "prometheus" / "alerts.yml"
ALERTS_TEST = REPO / "ops" / "prometheus" / "alerts_test.yml"
DASHBOARD = REPO / "ops" / "grafana" / "chessboard-overview.json"

#: Spec 000 "Наблюдаемость" and spec 003's freshness SLA, by alert name.
REQUIRED_ALERTS = {
    "CHESSBOARD_RECALC_BACKLOG",
    "CHESSBOARD_RECALC_SLOW",
    "CHESSBOARD_RECALC_ERRORS",
    "CHESSBOARD_RECALC_POISON",
    "CHESSBOARD_RECALC_WORKER_STALLED",
    "CHESSBOARD_RECALC_WORKER_DOWN",
    "DEVSTATS_LOADER_STALLED",
    "DEVSTATS_DIM_LAYOUT_GROUP_SLA_BREACHED",
    "DEVSTATS_LOADER_DEAD_LETTERS",
    "PIN_METRICS_SOURCE_DOWN",
    "CHESSBOARD_OUTBOX_LAG",
    "DEVSTATS_DIM_LAYOUT_GROUP_FRESHNESS",
}
#: Spec 000's metric names, which must be served as named.
SPEC_METRICS = {
    "chessboard_recalc_queue_depth",
    "chessboard_recalc_due_backlog",
    "chessboard_recalc_process_duration_seconds_bucket",
    "chessboard_recalc_runs_total",
    "chessboard_recalc_coalesced_events_total",
    "chessboard_recalc_republished_total",
}


@cache
def served_samples() -> frozenset[str]:
    """Every sample name the exporter can serve, from its collector's describe()."""
    families = list(PinCollector(sources(Settings.from_env({}))).describe())
    names = [f.name for f in families]
    assert len(names) == len(set(names)), f"a family is served twice: {sorted(names)}"
    return frozenset(served_series(families))


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_exporter_serves_the_spec_metrics() -> None:
    missing = SPEC_METRICS - served_samples()
    assert not missing, f"spec metrics not served: {sorted(missing)}"


def test_alerts_use_only_served_metrics_and_labels() -> None:
    rules = alert_rules()
    missing_alerts = REQUIRED_ALERTS - {rule["alert"] for rule in rules}
    assert not missing_alerts, f"alerts missing: {sorted(missing_alerts)}"
    exporter = served_series(PinCollector(sources(Settings.from_env({}))).describe())
    for rule in rules:
        report = check(rule["expr"], exporter)
        assert report.metrics, f"{rule['alert']} selects no metric"
        assert not report.problems, f"{rule['alert']}: {rule['expr']!r}: {report.problems}"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: install Debian's `prometheus` package"
    return subprocess.run(
        [binary, *args], cwd=ALERTS.parent, capture_output=True, text=True, timeout=120
    )


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", ALERTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    """Includes the poisoned-row series that must make CHESSBOARD_RECALC_POISON fire."""
    result = promtool("test", "rules", ALERTS_TEST.name)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the dashboard ---------------------------------------------------------------------------

#: The Grafana JSON model's version the dashboard is written in (the file's own).
GRAFANA_SCHEMA_VERSION = 39
GRAFANA_COLUMNS = 24
#: Grafana's variables, replaced for promtool by what they stand for at a 15 s scrape interval.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "6h"}


@cache
def dashboard_series() -> Mapping[str, frozenset[str]]:
    """Sample name → labels of everything this project serves to Prometheus: `pin metrics
    serve` (its collector's describe(), no service touched) and each `pin api serve` process
    (its own registry; one counted request gives its labelled families the samples that name
    their labels)."""
    exporter = served_series(PinCollector(sources(Settings.from_env({}))).describe())
    api_metrics = ApiMetrics()
    api_metrics.observe(200, "labels", 0.001)
    api = served_series(api_metrics.registry.collect())
    both = exporter.keys() & api.keys()
    assert not both, f"served by both the exporter and the API: {sorted(both)}"
    return {**exporter, **api}


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def dashboard_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested (collapsed) panels included."""
    for panel in panels:
        yield panel
        yield from dashboard_panels(panel.get("panels", []))


def dashboard_problems(panels: list[dict[str, Any]]) -> list[str]:
    """One line per unknown metric, label or function, or unparsable query, of every query of
    every panel, naming the panel and the expression; also a query that selects no metric."""
    problems = []
    for panel in dashboard_panels(panels):
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            report = check(expr, dashboard_series())
            found = report.problems or ([] if report.metrics else ["selects no metric"])
            problems += [f"panel {panel.get('title')!r}: {expr!r}: {p}" for p in found]
    return problems


def panel_reports(title: str) -> list[Report]:
    """The checker's reading of each query of the panel titled `title` (which must exist)."""
    panels = [p for p in dashboard_panels(dashboard()["panels"]) if p.get("title") == title]
    assert len(panels) == 1, f"{len(panels)} panels titled {title!r}"
    return [check(t["expr"], dashboard_series()) for t in panels[0]["targets"]]


def overlaps(a: dict[str, int], b: dict[str, int]) -> bool:
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


def test_promql_checker_reads_selectors_and_their_labels() -> None:
    """Names inside strings, comments, functions, keywords and durations are not selectors;
    by/without, on/ignoring and group_left labels are checked against the right side."""
    expr = (
        "# sum(not_a_metric)\n"
        'sum without (instance) (rate(devstats_api_requests_total{status=~"5..|rate"}[5m]'
        " offset 1h)) / on (job) group_left sum by (job) (rate(devstats_api_requests_total"
        "[1h:1m] @ end())) and on () (time() - max(chessboard_recalc_last_tick_timestamp_seconds)"
        " > bool 2 * 5) or label_replace(histogram_quantile(0.99, sum by (le, route) (rate("
        'devstats_api_request_duration_seconds_bucket[$__rate_interval]))), "r", "$1", "route",'
        ' "(.*)") * on (r) group_right max by (r, partition) (label_replace('
        'devstats_loader_lag_messages, "r", "x", "partition", "(.*)"))'
    )
    report = check(expr, dashboard_series())
    assert report.problems == []
    assert report.metrics == [
        "devstats_api_requests_total",
        "devstats_api_requests_total",
        "chessboard_recalc_last_tick_timestamp_seconds",
        "devstats_api_request_duration_seconds_bucket",
        "devstats_loader_lag_messages",
    ]


def test_promql_checker_rejects_unknown_metrics_and_labels() -> None:
    """The check itself proven: each mistake below is named, and a dashboard with them fails."""
    mistakes = {
        "sum(rate(devstats_loader_consumed[5m]))": "unknown metric 'devstats_loader_consumed'",
        "sum by (partitoin) (devstats_loader_lag_messages)": "unknown label 'partitoin'",
        'devstats_loader_lag_messages{topic="x"}': "unknown label 'topic'",
        "sum without (le) (chessboard_recalc_process_duration_seconds_sum)": "unknown label 'le'",
        "histogram_quantile(0.99, sum by (route) (rate(devstats_api_request_duration_seconds"
        "_bucket[5m])))": "unknown label 'le' in histogram_quantile",
        "sum by (status) (devstats_api_requests_total) / on (route) sum by (route)"
        " (devstats_api_request_duration_seconds_count)": "unknown label 'route' in / on (route)",
        "rat(pin_metrics_source_up[5m])": "unknown function 'rat'",
        "sum(pin_metrics_source_up": "cannot parse",
    }
    for expr, expected in mistakes.items():
        problems = check(expr, dashboard_series()).problems
        assert any(expected in p for p in problems), f"{expr!r}: {problems}"
    panels = [
        {
            "type": "row",
            "title": "nested",
            "panels": [
                {"title": "bad metric", "targets": [{"expr": "rate(pin_no_such_metric[5m])"}]},
                {
                    "title": "bad label",
                    "targets": [{"expr": "sum by (sorce) (pin_metrics_source_up)"}],
                },
                {"title": "no metric", "targets": [{"expr": "vector(1)"}]},
            ],
        }
    ]
    assert [p.split(": ")[0] for p in dashboard_problems(panels)] == [
        "panel 'bad metric'",
        "panel 'bad label'",
        "panel 'no metric'",
    ]


def test_dashboard_is_valid_grafana_json() -> None:
    doc = dashboard()
    assert doc["uid"] == "chessboard-overview"
    assert doc["schemaVersion"] == GRAFANA_SCHEMA_VERSION
    panels = list(dashboard_panels(doc["panels"]))
    ids = [panel["id"] for panel in panels]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), ids
    # Top-level panels share the grid; a collapsed row's panels share it among themselves.
    grids = [doc["panels"], *(p["panels"] for p in doc["panels"] if p.get("collapsed"))]
    for grid in grids:
        for i, panel in enumerate(grid):
            pos = panel["gridPos"]
            assert pos["x"] >= 0 and pos["w"] > 0 and pos["h"] > 0, panel["title"]
            assert pos["x"] + pos["w"] <= GRAFANA_COLUMNS, panel["title"]
            for other in grid[i + 1 :]:
                assert not overlaps(pos, other["gridPos"]), (panel["title"], other["title"])
    for panel in panels:
        if panel["type"] == "row":
            assert "targets" not in panel and (panel.get("collapsed") or not panel["panels"])
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]


def test_dashboard_uses_only_served_metrics_and_labels() -> None:
    """Panel by panel, every selector of every query is a sample `pin metrics serve` or `pin
    api serve` serves, and every label of its matchers and groupings one its family carries."""
    problems = dashboard_problems(dashboard()["panels"])
    assert not problems, "\n".join(problems)


def test_dashboard_shows_the_spec_panels() -> None:
    """Spec 000's recalc panels, spec 003's loader lag and freshness (its SLA drawn), and the
    read API's requests by status and latency."""
    queue = panel_reports("Queue depth and due backlog")
    assert {"chessboard_recalc_queue_depth", "chessboard_recalc_due_backlog"} <= {
        m for r in queue for m in r.metrics
    }
    p99 = panel_reports("Process duration p99 (SLO 2 s)")[0]
    assert p99.functions[-1] == "histogram_quantile" and ("sum", "by", ("le",)) in p99.groupings
    republished = panel_reports("Republished snapshots by entity")[0]
    assert ("sum", "by", ("entity",)) in republished.groupings
    lag = panel_reports("Loader lag by partition")[0]
    assert lag.metrics == ["devstats_loader_lag_messages"]
    assert lag.groupings[0][1:] == ("by", ("partition",))
    assert panel_reports("Dimension freshness (SLA 5 min)")[0].metrics == [
        "devstats_dim_layout_group_freshness_lag_seconds"
    ]
    freshness = next(
        p for p in dashboard_panels(dashboard()["panels"]) if p["title"].startswith("Dimension")
    )
    defaults = freshness["fieldConfig"]["defaults"]
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"
    assert 300 in [step["value"] for step in defaults["thresholds"]["steps"]]
    requests = panel_reports("API requests by status")[0]
    assert requests.metrics == ["devstats_api_requests_total"]
    assert ("sum", "by", ("status",)) in requests.groupings
    latency = panel_reports("API latency by route (labels p99 target 50 ms)")
    assert latency[0].metrics == ["devstats_api_request_duration_seconds_bucket"]
    assert latency[0].functions[-1] == "histogram_quantile"


def test_dashboard_expressions_parse_with_promtool(tmp_path: Path) -> None:
    """Prometheus' own parser over every query (as recording rules), Grafana's variables
    replaced: the checker above reads PromQL, this proves the queries are PromQL."""
    rules = []
    for panel in dashboard_panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr.replace('"$1"', ""), f"{panel['title']!r}: {expr!r}"
            rules.append(
                {"record": f"dashboard:panel_{panel['id']}:{target['refId']}", "expr": expr}
            )
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
