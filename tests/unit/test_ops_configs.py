"""The operator-facing configs of issue 7: alert rules and the Grafana dashboard parse, name only
metrics that `pin metrics serve` serves (the list comes from the exporter's own `describe()`), and
pass `promtool check rules` / `promtool test rules`.

promtool comes from Debian's `prometheus` package; without it these tests FAIL, they never skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from pin_pipelines.config import Settings
from pin_pipelines.metrics.collector import PinCollector, sources

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

PROMQL_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan",
}  # fmt: skip
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}


@cache
def served_samples() -> frozenset[str]:
    """Every sample name the exporter can serve, from its collector's describe()."""
    families = list(PinCollector(sources(Settings.from_env({}))).describe())
    names = [f.name for f in families]
    assert len(names) == len(set(names)), f"a family is served twice: {sorted(names)}"
    return frozenset(
        f"{family.name}{suffix}" for family in families for suffix in SAMPLE_SUFFIXES[family.type]
    )


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left after removing strings,
    label matchers, ranges, grouping clauses, function calls and keywords."""
    text = re.sub(r'"[^"]*"|\'[^\']*\'', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    found = set()
    for match in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", text):
        name, call = match.groups()
        if call is None and name.lower() not in PROMQL_KEYWORDS:
            found.add(name)
    return found


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_targets(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """(panel title, expr) of every query, rows' nested panels included."""
    for panel in panels:
        yield from dashboard_targets(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_metric_names_parser() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="b_c"}[5m]))) > 2'
        " and on() (time() - last_tick) > 2 * 5"
    )
    assert metric_names(expr) == {"a_bucket", "last_tick"}


def test_exporter_serves_the_spec_metrics() -> None:
    missing = SPEC_METRICS - served_samples()
    assert not missing, f"spec metrics not served: {sorted(missing)}"


def test_alerts_reference_only_served_metrics() -> None:
    rules = alert_rules()
    missing_alerts = REQUIRED_ALERTS - {rule["alert"] for rule in rules}
    assert not missing_alerts, f"alerts missing: {sorted(missing_alerts)}"
    for rule in rules:
        names = metric_names(rule["expr"])
        assert names, f"{rule['alert']} selects no metric"
        unknown = names - served_samples()
        assert not unknown, f"{rule['alert']} uses metrics the exporter does not serve: {unknown}"


def test_dashboard_references_only_served_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "chessboard-overview"
    targets = list(dashboard_targets(dashboard["panels"]))
    used: set[str] = set()
    for title, expr in targets:
        names = metric_names(expr)
        assert names, f"panel {title!r}: {expr!r} selects no metric"
        unknown = names - served_samples()
        assert not unknown, f"panel {title!r} uses metrics the exporter does not serve: {unknown}"
        used |= names
    # The spec's recalc panel: depth, backlog, p99, republished by entity; and a dev-stats panel.
    exprs = " ".join(expr for _, expr in targets)
    assert {"chessboard_recalc_queue_depth", "chessboard_recalc_due_backlog"} <= used
    assert "histogram_quantile(0.99" in exprs and "sum by (entity)" in exprs
    assert any(name.startswith("devstats_") for name in used)


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
