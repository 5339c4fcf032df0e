"""The Prometheus alert rules, rendered from their thresholds (spec 000: every threshold is a
setting).

`ops/prometheus/alerts.tmpl.yml` is the text; `ops/prometheus/alerts.yml` is its rendering at the
defaults below (a unit test keeps the two equal), so Prometheus can load the shipped file as it
is. An installation with other settings renders its own: `pin metrics rules --set NAME=VALUE`.
The template stays text, not YAML built in Python, so its comments reach the file on-call reads.
Placeholders are `%{name}`: `$` and `{{ }}` belong to Prometheus' own alert templates.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from string import Template

from pin_pipelines.config import DEFAULT_RECALC_TICK_SECONDS, SOURCE_ROOT
from pin_pipelines.errors import PinError

TEMPLATE = SOURCE_ROOT / "ops" / "prometheus" / "alerts.tmpl.yml"
RENDERED = SOURCE_ROOT / "ops" / "prometheus" / "alerts.yml"

#: A Prometheus duration as the rules use them: `90s`, `5m`, `1h`.
_DURATION = re.compile(r"[0-9]+(ms|s|m|h|d)")


@dataclass(frozen=True)
class AlertThresholds:
    """Every number the rules compare with. Fields ending in `_for` hold an alert pending that
    long; `_window` fields are PromQL ranges; both are Prometheus durations."""

    #: The recalc scheduler's interval (PIN_RECALC_TICK_SECONDS) and the spec's "> 2 intervals".
    tick_seconds: int = DEFAULT_RECALC_TICK_SECONDS
    missed_ticks: int = 2
    worker_down_for: str = "10s"
    worker_stalled_for: str = "1m"
    #: One batch of due rows (recalc_settings.batch_size's default).
    backlog_rows: int = 50
    backlog_for: str = "5m"
    slow_p99_seconds: float = 2.0
    slow_for: str = "10m"
    errors_window: str = "10m"
    errors_count: int = 3
    errors_ratio: float = 0.05
    errors_for: str = "5m"
    poison_for: str = "0s"
    outbox_lag_seconds: float = 60.0
    outbox_lag_for: str = "2m"
    loader_stall_window: str = "2m"
    loader_stall_for: str = "1m"
    #: Spec 003's SLA, and the warning that comes while there is time to act.
    freshness_warn_seconds: float = 120.0
    freshness_sla_seconds: float = 300.0
    dead_letter_window: str = "15m"
    source_down_for: str = "5m"
    #: Where the runbook is published; the rules link its sections (`#anchor`) from here.
    runbook_url: str = "docs/runbook.md"


def thresholds_with(
    assignments: Iterable[str], base: AlertThresholds | None = None
) -> AlertThresholds:
    """`base` (the defaults) with NAME=VALUE assignments applied, each checked for its type."""
    kinds = {f.name: f.type for f in fields(AlertThresholds)}
    changes: dict[str, int | float | str] = {}
    for assignment in assignments:
        name, sep, raw = assignment.partition("=")
        if not sep or name not in kinds:
            raise PinError(
                f"--set takes NAME=VALUE with NAME one of {', '.join(kinds)}; got {assignment!r}"
            )
        changes[name] = _parse(name, str(kinds[name]), raw)
    # Each value was parsed for its own field's type above; mypy sees only the union.
    return replace(base or AlertThresholds(), **changes)  # type: ignore[arg-type]


def _parse(name: str, kind: str, raw: str) -> int | float | str:
    if kind == "int" and raw.isdecimal() and int(raw) >= 1:
        return int(raw)
    if kind == "float":
        try:
            if float(raw) >= 0:
                return float(raw)
        except ValueError:
            pass
    if kind == "str" and name == "runbook_url" and raw and not raw.isspace():
        return raw
    if kind == "str" and _DURATION.fullmatch(raw):
        return raw
    expected = {"int": "a whole number ≥ 1", "float": "a number ≥ 0"}.get(
        kind, "a URL" if name == "runbook_url" else "a Prometheus duration such as 30s or 5m"
    )
    raise PinError(f"{name} must be {expected}, got {raw!r}")


class _RulesTemplate(Template):
    delimiter = "%"


def render_rules(thresholds: AlertThresholds | None = None) -> str:
    """The rules file for `thresholds` (the defaults: the shipped ops/prometheus/alerts.yml)."""
    t = thresholds or AlertThresholds()
    values = {f.name: _text(getattr(t, f.name)) for f in fields(t)}
    note = (
        "Rendered from alerts.tmpl.yml by `pin metrics rules`; edit the template, not this file."
        if t == AlertThresholds()
        else "Rendered by `pin metrics rules` with thresholds other than the defaults."
    )
    return _RulesTemplate(TEMPLATE.read_text()).substitute(values, generated_note=note)


def _text(value: object) -> str:
    """Numbers as a person writes them: 5, 0.05, 120 (not 120.0)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
