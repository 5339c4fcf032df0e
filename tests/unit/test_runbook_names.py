"""Every job, schedule, sensor, asset, asset check, metric and alert that docs/runbook.md names
exists under that name (the runbook sent on-call to a schedule that Dagster calls
otherwise). Nothing here needs a service: the names come from `pin_pipelines.definitions.defs`,
the exporter's describe(), the read API's own metrics and ops/prometheus/alerts.yml.

A name is an inline code span (`…`) outside fenced blocks whose whole text is one identifier; its
kind comes from
- its shape: `…_job`, `…_schedule`, `…_sensor` (how this project names those), an asset key
  path under a root the assets use (`chessboard/aggregates`; `kafka/*` is a pattern), a metric
  namespace the exporter serves (`chessboard_recalc_…`), or UPPER_SNAKE (an alert, or a setting
  in README.md's Settings);
- else the runbook's own words around it: "job `x`", "*Jobs* → `x`", "sensor `x`", "check `x`",
  "*Checks* → `x`", a list under "*Checks*:", "`x` passes/fails", "asset `x`", "*Catalog* → `x`",
  "*Materialize* `x`".
Other spans (commands, SQL, metadata keys such as `processed`, columns, config values) are not
names of those kinds and are left alone, so metadata or commands can be documented freely; a
misnamed object is caught wherever its shape or the words next to it say what it is.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pin_pipelines.api.observe import ApiMetrics
from pin_pipelines.config import Settings
from pin_pipelines.metrics.collector import PinCollector, sources
from tests.unit.test_ops_configs import alert_rules, served_samples

REPO = Path(__file__).resolve().parents[2]
RUNBOOK = REPO / "docs" / "runbook.md"
README = REPO / "README.md"

_FENCE = re.compile(r"^ *```.*?^ *```[^\n]*$", re.M | re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
_LOWER = re.compile(r"[a-z][a-z0-9_]*")
_ASSET_PATH = re.compile(r"[a-z0-9_*]+(?:/[a-z0-9_*]+)+")
_UPPER = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
_SUFFIX_KINDS = {"_job": "job", "_schedule": "schedule", "_sensor": "sensor"}
#: The runbook's words right before a span ("*Jobs* → `x`", "check `x`") or right after it.
_BEFORE = [
    (re.compile(r"(?:\bjobs?|\*Jobs\*\s*→)\s*$"), "job"),
    (re.compile(r"\bschedules?\s*$"), "schedule"),
    (re.compile(r"\bsensors?\s*$"), "sensor"),
    (re.compile(r"(?:\bchecks?|\*Checks\*\s*→)\s*$"), "check"),
    (re.compile(r"(?:\bassets?|\*Catalog\*\s*→|\*Materialize\*)\s*$"), "asset"),
]
_AFTER = [(re.compile(r"^\s*(?:passes|pass|fails)\b"), "check")]
#: A line ending like this opens a list whose items start with names of that kind.
_LIST_HEADS = [(re.compile(r"\*Checks\*:\s*$"), "check")]
_LIST_ITEM = re.compile(r"^(\s*)[-*] `([^`\n]+)`")


@dataclass(frozen=True)
class Mention:
    line: int
    name: str
    kind: str


@dataclass(frozen=True)
class Namespaces:
    """Prefixes that make a span a name by its shape alone: the exporter's metric namespaces
    (`chessboard_recalc_`) and the roots of multi-part asset keys (`chessboard`, `kafka`), so a
    folder like `sql/postgres` is not taken for an asset."""

    metric_prefixes: frozenset[str]
    asset_roots: frozenset[str]


def _blank_fences(text: str) -> str:
    """Fenced blocks (YAML for the launchpad, shell) become blank lines: line numbers stay."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _kind_by_shape(name: str, namespaces: Namespaces) -> str | None:
    if _UPPER.fullmatch(name):
        return "alert or setting"
    if _ASSET_PATH.fullmatch(name) and name.split("/")[0] in namespaces.asset_roots:
        return "asset"
    if not _LOWER.fullmatch(name):
        return None
    for suffix, kind in _SUFFIX_KINDS.items():
        if name.endswith(suffix):
            return kind
    if name.startswith(tuple(namespaces.metric_prefixes)):
        return "metric"
    return None


def _list_kinds(lines: list[str]) -> dict[int, str]:
    """Line index → kind, for the items of each list that a heading like "*Checks*:" opens."""
    found: dict[int, str] = {}
    kind: str | None = None
    indent: int | None = None
    for index, line in enumerate(lines):
        item = _LIST_ITEM.match(line)
        if kind is not None and item and indent in (None, len(item.group(1))):
            indent = len(item.group(1))
            found[index] = kind
            continue
        outdented = len(line) - len(line.lstrip()) <= (indent or 0)
        if kind is not None and indent is not None and line.strip() and outdented:
            kind, indent = None, None  # a line that is not an item's continuation ends the list
        for head, head_kind in _LIST_HEADS:
            if head.search(line):
                kind, indent = head_kind, None
    return found


def mentions(markdown: str, namespaces: Namespaces) -> Iterator[Mention]:
    """The names a Markdown text mentions, with the kind each must exist as."""
    lines = _blank_fences(markdown).split("\n")
    listed = _list_kinds(lines)
    for index, line in enumerate(lines):
        for span in _SPAN.finditer(line):
            name = span.group(1).strip()
            kind = _kind_by_shape(name, namespaces)
            if kind is None and _LOWER.fullmatch(name):
                before, after = line[: span.start()], line[span.end() :]
                kinds = [k for pattern, k in _BEFORE if pattern.search(before)]
                kinds += [k for pattern, k in _AFTER if pattern.search(after)]
                if span.start() == line.index("`") and index in listed:
                    kinds.append(listed[index])
                kind = kinds[0] if kinds else None
            if kind is not None:
                yield Mention(index + 1, name, kind)


@cache
def existing() -> dict[str, frozenset[str]]:
    """Every name that exists, by kind."""
    from pin_pipelines.definitions import defs

    repository = defs.get_repository_def()
    asset_graph = repository.asset_graph
    families = {f.name for f in PinCollector(sources(Settings.from_env({}))).describe()}
    families |= api_metric_names()
    readme = README.read_text()
    settings_section = readme.split("\n## Settings", 1)[1].split("\n## ", 1)[0]
    return {
        "job": frozenset(j.name for j in repository.get_all_jobs() if not j.name.startswith("__")),
        "schedule": frozenset(s.name for s in repository.schedule_defs),
        "sensor": frozenset(s.name for s in repository.sensor_defs),
        "asset": frozenset(k.to_user_string() for k in asset_graph.get_all_asset_keys()),
        "check": frozenset(k.name for k in asset_graph.asset_check_keys),
        "metric": frozenset(families | served_samples()),
        "alert or setting": frozenset(
            {rule["alert"] for rule in alert_rules()}
            | {name for name in _SPAN.findall(settings_section) if _UPPER.fullmatch(name)}
        ),
    }


def api_metric_names() -> set[str]:
    """The families and samples the read API serves at its own /metrics (PIN_API_METRICS_PORT;
    one request counted, so that the labelled ones have samples)."""
    metrics = ApiMetrics()
    metrics.observe(200, "labels", 0.001)
    families = list(metrics.registry.collect())
    return {f.name for f in families} | {s.name for f in families for s in f.samples}


def project_namespaces() -> Namespaces:
    """Metric namespaces two words deep (`chessboard_recalc_`, `devstats_loader_`, …)."""
    names = existing()
    return Namespaces(
        metric_prefixes=frozenset("_".join(n.split("_")[:2]) + "_" for n in names["metric"]),
        asset_roots=frozenset(n.split("/")[0] for n in names["asset"] if "/" in n),
    )


def exists(mention: Mention) -> bool:
    names = existing()[mention.kind]
    if mention.kind == "asset":
        return any(fnmatch.fnmatchcase(name, mention.name) for name in names)
    return mention.name in names


def test_the_extraction_classifies_names_and_leaves_prose_alone() -> None:
    """A sample in the runbook's style: each kind of mention is found with its kind; commands,
    metadata keys, SQL and fenced launchpad YAML are not names."""
    sample = "\n".join(
        [
            "1. *Automation* → sensor `a_sensor`; *Jobs* → `a_job` (`processed`, `failed`).",
            "2. *Catalog* → `chessboard/aggregates` → *Checks* → `no_poison`; job `other`.",
            "3. Every minute (schedule `a_schedule`), `pin recalc drain --once`, `x = 1`.",
            "4. *Catalog* → `dim` → *Checks*:",
            "   - `fresh_check` (every minute) fails when the loader is behind, and keeps",
            "     `not_a_check` in its continuation line.",
            "   - `current_check` (every 10 minutes).",
            "5. `after_list` is prose again; `some_check` passes. Alert `PIN_METRICS_SOURCE_DOWN`,",
            "   metric `chessboard_recalc_runs_total`, assets `kafka/*`, folder `sql/postgres`.",
            "```yaml",
            "ops:",
            "  `fenced_job`:",
            "```",
        ]
    )
    namespaces = Namespaces(frozenset({"chessboard_recalc_"}), frozenset({"chessboard", "kafka"}))
    found = [(m.line, m.name, m.kind) for m in mentions(sample, namespaces)]
    assert found == [
        (1, "a_sensor", "sensor"),
        (1, "a_job", "job"),
        (2, "chessboard/aggregates", "asset"),
        (2, "no_poison", "check"),
        (2, "other", "job"),
        (3, "a_schedule", "schedule"),
        (4, "dim", "asset"),
        (5, "fresh_check", "check"),
        (7, "current_check", "check"),
        (8, "some_check", "check"),
        (8, "PIN_METRICS_SOURCE_DOWN", "alert or setting"),
        (9, "chessboard_recalc_runs_total", "metric"),
        (9, "kafka/*", "asset"),
    ]


def test_every_name_in_the_runbook_exists() -> None:
    found = list(mentions(RUNBOOK.read_text(), project_namespaces()))
    assert {m.kind for m in found} >= {"job", "schedule", "sensor", "asset", "check"}, found
    problems = []
    for mention in found:
        if exists(mention):
            continue
        close = difflib.get_close_matches(mention.name, existing()[mention.kind], n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        problems.append(
            f"docs/runbook.md:{mention.line}: {mention.kind} `{mention.name}` does not exist{hint}"
        )
    assert not problems, "\n".join(problems)
