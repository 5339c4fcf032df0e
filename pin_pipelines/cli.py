"""The `pin` command (contract section 2). Every command calls the same core as the Dagster
definitions; failures print one line on stderr and exit non-zero, never a bare traceback."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn
from uuid import UUID

from pin_pipelines.config import Settings, traceback_requested
from pin_pipelines.errors import PinError, first_line
from pin_pipelines.kafka_properties import read_properties
from pin_pipelines.logs import configure_cli_logging
from pin_pipelines.redact import redact_url

Handler = Callable[[argparse.Namespace, Settings], Any]


def _uuid(value: str) -> UUID:
    try:
        return UUID(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a UUID: {value!r}") from None


def _uuid_list(value: str) -> list[UUID]:
    return [_uuid(part.strip()) for part in value.split(",") if part.strip()]


def _summary(obj: Any) -> None:
    """The JSON summary is the last line on stdout (contract)."""
    print(json.dumps(obj, default=str, ensure_ascii=False), flush=True)


# --- stack -----------------------------------------------------------------------------------


def cmd_stack(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.stack import services

    action = {"up": services.up, "down": services.down, "status": services.status}[args.action]
    results = action(
        settings,
        clickhouse_server_too=args.clickhouse_server,
        clickhouse_cluster=args.clickhouse_cluster,
        kafka_brokers=args.kafka_brokers,
        secure=args.secure,
    )
    for result in results:
        print(services.describe(result), file=sys.stderr)
    if args.secure and args.action == "up":
        # The settings to export (file paths and names only: the secrets stay in their files).
        exports = services.SecuredEstate(settings).exports()
        for name, value in exports.items():
            print(f"export {name}={shlex.quote(value)}")
        _summary({"services": results, "settings": exports})
        return
    _summary({"services": results})


def cmd_serve(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.serve import serve

    serve(settings)


def cmd_dev(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.serve import dagster_dev

    dagster_dev(settings)


def cmd_dagster_prune(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.housekeeping import RetentionPolicy, prune_runs
    from pin_pipelines.serve import open_instance

    with open_instance(settings) as instance:
        summary = prune_runs(
            instance, RetentionPolicy.from_settings(settings), dry_run=args.dry_run
        )
    _summary(summary.as_dict())


def cmd_db_migrate(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.migrate import migrate_all

    _summary(migrate_all(settings, allow_weaker_topics=args.allow_weaker_topics))


def cmd_sample_load(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.recalc import load_sample

    _summary(load_sample(settings.pg_dsn, projects=args.projects))


# --- recalc ----------------------------------------------------------------------------------


def cmd_recalc_request(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.recalc import RecalcReason, force_recalc

    by_name = {r.value.lower(): r for r in RecalcReason}
    reason = by_name.get(args.reason.lower())
    if reason is None:
        choices = ", ".join(r.value for r in RecalcReason)
        raise PinError(f"--reason must be one of: {choices}")
    force_recalc(settings.pg_dsn, args.project_id, reason)
    _summary({"requested": str(args.project_id), "reason": reason.value})


def cmd_recalc_drain(args: argparse.Namespace, settings: Settings) -> None:
    """SIGTERM/SIGINT finish the project in hand; the rest of the batch stays queued."""
    from pin_pipelines.recalc import drain_tick
    from pin_pipelines.signals import stop_requested

    stop = stop_requested()
    _summary(drain_tick(settings.pg_dsn, batch_size=args.batch_size, should_stop=stop).as_dict())


def cmd_recalc_requeue(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.recalc import requeue_poisoned

    requeue_poisoned(settings.pg_dsn, args.project_id)
    _summary({"requeued": str(args.project_id)})


# --- outbox, devstats, reconcile -------------------------------------------------------------


def cmd_outbox_relay(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.relay import OutboxRelay, relay_once
    from pin_pipelines.signals import stop_requested

    options = {} if args.batch_size is None else {"batch_size": args.batch_size}
    if args.once:
        _summary(relay_once(settings, **options).as_dict())
        return
    stopping = stop_requested()  # SIGTERM/SIGINT: the batch in hand commits, then exit 0
    with OutboxRelay(settings, **options) as relay:
        _summary(relay.run_until(stopping).as_dict())


def cmd_devstats_load(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.devstats.loading import LoadOptions, load_continuously, load_once
    from pin_pipelines.signals import stop_requested

    if args.once:
        _summary(load_once(settings).as_dict())
        return
    stopping = stop_requested()  # SIGTERM/SIGINT: the batch in hand commits, then exit 0
    options = LoadOptions(max_seconds=float("inf"), should_stop=stopping)
    _summary(load_continuously(settings, options).as_dict())


def cmd_devstats_backfill(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.devstats.loading import IdRange, backfill

    ids = IdRange(args.from_id, args.to_id)  # an empty range fails here, before any replay
    _summary(backfill(settings, ids=ids).as_dict())


def cmd_devstats_labels(args: argparse.Namespace, settings: Settings) -> None:
    """An operator's read: the developer is named on the command line, so the Actor comes from
    the operator's door (devstats/operator.py, through `devstats.loading`), which the read API
    cannot reach."""
    from pin_pipelines.clickhouse import open_clickhouse
    from pin_pipelines.devstats import labels
    from pin_pipelines.devstats.loading import operator_actor

    if not args.ids:
        raise PinError("--ids needs at least one UUID")
    with open_clickhouse(
        settings.clickhouse_url, password_file=settings.clickhouse_password_file
    ) as ch:
        _summary(labels(ch, operator_actor(args.developer_id), args.ids, args.project_id))


def cmd_reconcile(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.reconcile import reconcile

    _summary(reconcile(settings, repair=args.repair).as_dict())


def cmd_api_serve(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.api import serve_api

    serve_api(settings)


def cmd_metrics_serve(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.metrics import serve_metrics

    serve_metrics(settings, port=args.port)


def cmd_metrics_rules(args: argparse.Namespace, settings: Settings) -> None:
    from pin_pipelines.metrics.rules import AlertThresholds, render_rules, thresholds_with

    base = AlertThresholds(tick_seconds=settings.recalc_tick_seconds)
    sys.stdout.write(render_rules(thresholds_with(args.set, base)))


# --- parser ----------------------------------------------------------------------------------


class _OneLineParser(argparse.ArgumentParser):
    """A bad argument is one line on stderr, like every other failure (`-h` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="pin", description=__doc__)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_OneLineParser
    )

    stack = sub.add_parser("stack", help="local services: PostgreSQL, Kafka, ClickHouse server")
    stack.add_argument("action", choices=["up", "down", "status"])
    stack.add_argument(
        "--clickhouse-server",
        action="store_true",
        help="also manage the Debian clickhouse-server (implied by a local clickhouse:// URL)",
    )
    stack.add_argument(
        "--clickhouse-cluster",
        action="store_true",
        help="also manage a local ClickHouse cluster: ZooKeeper and three clickhouse-servers, "
        "2 shards, one with 2 replicas (implied by PIN_CLICKHOUSE_CLUSTER with a local URL)",
    )
    stack.add_argument(
        "--kafka-brokers",
        type=int,
        metavar="N",
        help="a local KRaft cluster of N Kafka nodes on PIN_KAFKA_BOOTSTRAP's port + 0, 2, 4, … "
        "(default: the single broker, or the cluster that runs)",
    )
    stack.add_argument(
        "--secure",
        action="store_true",
        help="a secured estate beside the plain stack: TLS and passwords for PostgreSQL (SCRAM), "
        "Kafka (SASL_SSL) and ClickHouse (TLS port, writer and reader); `up` prints the "
        "settings to export",
    )
    stack.set_defaults(handler=cmd_stack)

    serve = sub.add_parser("serve", help="dagster-daemon + dagster-webserver until interrupted")
    serve.set_defaults(handler=cmd_serve)

    dev = sub.add_parser("dev", help="`dagster dev` on the project's instance (local use)")
    dev.set_defaults(handler=cmd_dev)

    dagster = sub.add_parser("dagster", help="the Dagster instance").add_subparsers(
        dest="dagster_command", required=True
    )
    prune = dagster.add_parser(
        "prune", help="delete finished runs past retention with their event and compute logs"
    )
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    prune.set_defaults(handler=cmd_dagster_prune)

    db = sub.add_parser("db", help="schema").add_subparsers(dest="db_command", required=True)
    migrate = db.add_parser("migrate", help="PostgreSQL schema, ClickHouse database, Kafka topics")
    migrate.add_argument(
        "--allow-weaker-topics",
        action="store_true",
        help="accept existing Kafka topics with fewer partitions or a lower replication factor or "
        "min.insync.replicas than the settings (reported in the summary either way)",
    )
    migrate.set_defaults(handler=cmd_db_migrate)

    sample = sub.add_parser("sample", help="demo data").add_subparsers(
        dest="sample_command", required=True
    )
    sample_load = sample.add_parser(
        "load", help="insert random demo projects (raisers enqueue them)"
    )
    sample_load.add_argument("--projects", type=int, default=20)
    sample_load.set_defaults(handler=cmd_sample_load)

    recalc = sub.add_parser("recalc", help="the aggregates recalc queue").add_subparsers(
        dest="recalc_command", required=True
    )
    request = recalc.add_parser("request", help="force-recalc a project now")
    request.add_argument("--project-id", type=_uuid, required=True)
    request.add_argument("--reason", default="Manual")
    request.set_defaults(handler=cmd_recalc_request)
    drain = recalc.add_parser("drain", help="drain due rows")
    drain.add_argument("--once", action="store_true", required=True, help="one worker tick")
    drain.add_argument("--batch-size", type=int, default=None)
    drain.set_defaults(handler=cmd_recalc_drain)
    requeue = recalc.add_parser("requeue", help="reset a poison row and make it due now")
    requeue.add_argument("--project-id", type=_uuid, required=True)
    requeue.set_defaults(handler=cmd_recalc_requeue)

    outbox = sub.add_parser("outbox", help="transactional outbox").add_subparsers(
        dest="outbox_command", required=True
    )
    relay = outbox.add_parser("relay", help="publish committed outbox events to Kafka")
    relay.add_argument(
        "--once", action="store_true", help="up to the events committed at the start, then exit"
    )
    relay.add_argument(
        "--batch-size", type=int, default=None, help="events per Kafka transaction (max 20000)"
    )
    relay.set_defaults(handler=cmd_outbox_relay)

    devstats = sub.add_parser("devstats", help="dev-stats dimension").add_subparsers(
        dest="devstats_command", required=True
    )
    load = devstats.add_parser(
        "load", help="Kafka → ClickHouse dim_layout_group, continuously until SIGTERM/SIGINT"
    )
    load.add_argument(
        "--once", action="store_true", help="up to the events in the topic at the start, then exit"
    )
    load.set_defaults(handler=cmd_devstats_load)
    backfill = devstats.add_parser(
        "backfill",
        help="replay the topic from its beginning into dim_layout_group (the version guard "
        "skips what is stored); with --from-id/--to-id only those LayoutGroupIds are inserted",
    )
    backfill.add_argument(
        "--from-id", type=_uuid, metavar="UUID", help="first LayoutGroupId (included)"
    )
    backfill.add_argument(
        "--to-id", type=_uuid, metavar="UUID", help="last LayoutGroupId (included)"
    )
    backfill.set_defaults(handler=cmd_devstats_backfill)
    labels = devstats.add_parser("labels", help="layout-group labels for one developer")
    labels.add_argument("--developer-id", type=_uuid, required=True)
    labels.add_argument("--ids", type=_uuid_list, required=True)
    labels.add_argument(
        "--project-id", type=_uuid, help="only groups of this project; others get their id"
    )
    labels.set_defaults(handler=cmd_devstats_labels)

    reconcile = sub.add_parser("reconcile", help="drift report (and repair)")
    reconcile.add_argument("--repair", action="store_true")
    reconcile.set_defaults(handler=cmd_reconcile)

    api = sub.add_parser("api", help="the dev-stats read API").add_subparsers(
        dest="api_command", required=True
    )
    api_serve = api.add_parser(
        "serve",
        help="serve the read API on PIN_API_ADDR:PIN_API_PORT, its /metrics on "
        "PIN_API_METRICS_PORT, until SIGTERM/SIGINT (bearer tokens of PIN_API_JWKS_URL's keys, "
        "PIN_API_ISSUER, PIN_API_AUDIENCE)",
    )
    api_serve.set_defaults(handler=cmd_api_serve)

    metrics = sub.add_parser("metrics", help="Prometheus exporter").add_subparsers(
        dest="metrics_command", required=True
    )
    metrics_serve = metrics.add_parser("serve", help="serve /metrics until interrupted")
    metrics_serve.add_argument("--port", type=int, default=None, help="default PIN_METRICS_PORT")
    metrics_serve.set_defaults(handler=cmd_metrics_serve)
    metrics_rules = metrics.add_parser(
        "rules", help="print the Prometheus alert rules for these thresholds"
    )
    metrics_rules.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a threshold other than its default (repeatable); the tick is PIN_RECALC_TICK_SECONDS",
    )
    metrics_rules.set_defaults(handler=cmd_metrics_rules)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_cli_logging()
    try:
        settings = Settings.from_env()
        read_properties()  # a bad PIN_KAFKA_CONFIG fails the command before it touches anything
        args.handler(args, settings)
    except PinError as exc:
        print(f"pin: error: {redact_url(first_line(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pin: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the contract: a one-line message, never a bare traceback
        if traceback_requested():
            traceback.print_exc()
        what = f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else first_line(exc)
        print(f"pin: error: {redact_url(what)} (PIN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
