"""The Kubernetes deployment (deploy/). Nothing here can start a cluster, so these tests
hold the configuration to what Dagster itself accepts and to the repository's own instance:

- deploy/k8s/dagster.yaml passes Dagster's instance config validation, and every configurable class
  it names (K8sRunLauncher, QueuedRunCoordinator, the PostgreSQL storages, ...) imports and accepts
  its `config:`; a misspelt key anywhere fails (the negative cases keep proving it).
- deploy/helm/values.yaml renders that file: its sections are derived from the values the way the
  chart's templates (dagster/dagster 1.13.27) write them, and compared.
- The run queue limits, pools, retries, run monitoring and retention equal the repository's
  dagster.yaml as `pin serve` installs it (pin_pipelines/dagster_instance.py), its drain limit
  taken from the PIN_RECALC_MAX_DRAIN_RUNS that the values give the code server.
- The code server and the run workers get the contract's settings, and the Dockerfile serves the
  code location that the values, pyproject.toml and workspace.yaml name.
- The read API's Deployment and Service (deploy/k8s/dev-stats-api.yaml): every key
  checked against the Kubernetes API models of the `kubernetes` client (a misspelt key fails),
  `pin api serve` in the code server's image on the port its Service and probes name, and the
  settings the pod gets valid for the API: a ClickHouse server, the identity provider, all
  interfaces of the pod.
- Credentials (CONTRACT section 8): no file under deploy/ holds one (no Secret with data, no URL
  with a password, no password-like key with a literal value); they come only from the Secrets
  the example manifest's comments tell the operator to create, as environment variables
  (PGUSER/PGPASSWORD) or as files mounted whole where the settings' paths point, in every pod that
  runs project code (code server, run workers, read API, migrate Job); the migrate Job alone is
  the schema owner.

No service is needed: everything is read from files and Dagster's schemas.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.util
import json
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import reduce
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import parse_qs, urlsplit

import dagster
import pytest
import yaml
from dagster._config import Shape, process_config, resolve_to_config_type, validate_config
from dagster._core.errors import DagsterInvalidConfigError
from dagster._core.instance.config import dagster_instance_config, dagster_instance_config_schema
from dagster._core.run_coordinator import QueuedRunCoordinator
from dagster._serdes.config_class import (
    ConfigurableClass,
    ConfigurableClassData,
    class_from_code_pointer,
)
from dagster_k8s import K8sRunLauncher

from pin_pipelines.clickhouse.url import DATABASE as CLICKHOUSE_DATABASE
from pin_pipelines.config import LOOPBACK_HOSTS, Settings
from pin_pipelines.dagster_instance import instance_config

REPO = Path(__file__).resolve().parents[2]
VALUES = REPO / "deploy" / "helm" / "values.yaml"
K8S_DIR = REPO / "deploy" / "k8s"
INSTANCE = K8S_DIR / "dagster.yaml"
ENV_MANIFEST = K8S_DIR / "pin-env.example.yaml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
API_MANIFEST = K8S_DIR / "dev-stats-api.yaml"
MIGRATE_MANIFEST = K8S_DIR / "pin-db-migrate.yaml"

#: The namespace the values' install command uses (`helm upgrade --install pin ... -n pin`): the
#: chart fills the run launcher's job namespace from it.
RELEASE_NAMESPACE = "pin"

#: The instance sections that name a configurable class (`module`, `class`, `config`).
CLASS_SECTIONS = (
    "scheduler",
    "run_storage",
    "event_log_storage",
    "schedule_storage",
    "run_launcher",
    "run_coordinator",
    "compute_logs",
)

#: The sections the Kubernetes instance shares with the repository's dagster.yaml, value for value.
SHARED_SECTIONS = ("concurrency", "retention", "run_retries", "telemetry")

Config = dict[str, Any]


def load_yaml(path: Path) -> Config:
    loaded: Config = yaml.safe_load(path.read_text())
    return loaded


def configured_class(section: Mapping[str, Any]) -> type[ConfigurableClass]:
    """The class a section names, resolved as the instance resolves it (`dagster.core.*` is the
    public alias of `dagster._core.*`)."""
    data = ConfigurableClassData(section["module"], section["class"], "{}\n")
    klass = class_from_code_pointer(data.module_name, data.class_name)
    assert issubclass(klass, ConfigurableClass), f"{klass} is not a configurable class"
    return klass


def validated_instance(base_dir: Path) -> Mapping[str, Any]:
    """The dagster.yaml in `base_dir` through Dagster's own validation: the instance schema (which
    takes any `config:` under a class), then each named class's schema, as the instance applies it
    when it builds the object. Nothing is built: the launcher would look for a cluster, and
    `env:` values stay unresolved."""
    config, _ = dagster_instance_config(str(base_dir))
    for name in CLASS_SECTIONS:
        if name in config:
            klass = configured_class(config[name])
            section_config = config[name].get("config") or {}
            result = validate_config(resolve_to_config_type(klass.config_type()), section_config)
            if not result.success:
                raise DagsterInvalidConfigError(
                    f"Errors in the config of {name} ({klass.__name__}).",
                    result.errors,
                    section_config,
                )
    return config


def names(refs: Iterable[Mapping[str, str]]) -> list[str]:
    """The chart's `[{name: ...}]` references as the plain names the instance lists."""
    return [ref["name"] for ref in refs]


def snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def snake_keys(section: Mapping[str, Any]) -> Config:
    """A flat values section with the instance's key names (`startTimeoutSeconds` →
    `start_timeout_seconds`), nulls left out as the chart's templates leave them out."""
    return {snake(key): value for key, value in section.items() if value is not None}


def code_server(values: Mapping[str, Any]) -> Config:
    """The one user deployment: the `pin_pipelines.definitions` code location."""
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    server: Config = deployment
    return server


def chart_instance(values: Mapping[str, Any]) -> Config:
    """The instance config that the chart's templates (configmap-instance.yaml and
    helpers/instance/*.tpl in dagster/dagster 1.13.27) write for these values, for every section
    the values set; only the choices these values make are followed (K8sRunLauncher, the queued
    coordinator, external PostgreSQL, no compute log capture)."""
    fullname = values["fullnameOverride"]
    postgres = values["postgresql"]
    daemon = values["dagsterDaemon"]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert daemon["runCoordinator"]["type"] == "QueuedRunCoordinator"
    assert values["computeLogManager"]["type"] == "NoOpComputeLogManager"
    assert not postgres["enabled"], "Dagster's storage is an external PostgreSQL"
    assert values["retention"]["enabled"] and values["concurrency"]["enabled"]
    assert daemon["runMonitoring"]["enabled"]
    assert not any(daemon["runCoordinator"]["config"]["queuedRunCoordinator"].values()), (
        "the run queue's limits belong under `concurrency` (the chart refuses both)"
    )

    storage = {
        "postgres_db": {
            "username": postgres["postgresqlUsername"],
            "password": {"env": "DAGSTER_PG_PASSWORD"},
            "hostname": postgres["postgresqlHost"],
            "db_name": postgres["postgresqlDatabase"],
            "port": postgres["service"]["port"],
            "params": postgres["postgresqlParams"],
            "scheme": postgres["postgresqlScheme"],
        }
    }
    optional_launcher_lists = {
        "env_vars": launcher["envVars"],
        "volume_mounts": launcher["volumeMounts"],
        "volumes": launcher["volumes"],
    }
    run_k8s_config = {
        snake(key): value for key, value in launcher.get("runK8sConfig", {}).items() if value
    }
    run_retries: Config = {}
    if daemon["runRetries"]["enabled"]:  # the template writes the section only then
        run_retries["run_retries"] = {"enabled": True}
        if daemon["runRetries"]["maxRetries"]:  # the template drops a 0
            run_retries["run_retries"]["max_retries"] = daemon["runRetries"]["maxRetries"]
    concurrency = values["concurrency"]
    retention = values["retention"]
    rendered: Config = {
        "scheduler": {"module": "dagster.core.scheduler", "class": "DagsterDaemonScheduler"},
        "run_storage": {
            "module": "dagster_postgres.run_storage",
            "class": "PostgresRunStorage",
            "config": storage,
        },
        "event_log_storage": {
            "module": "dagster_postgres.event_log",
            "class": "PostgresEventLogStorage",
            "config": storage,
        },
        "schedule_storage": {
            "module": "dagster_postgres.schedule_storage",
            "class": "PostgresScheduleStorage",
            "config": storage,
        },
        "run_launcher": {
            "module": "dagster_k8s",
            "class": "K8sRunLauncher",
            "config": {
                "load_incluster_config": launcher["loadInclusterConfig"],
                "job_namespace": launcher["jobNamespace"] or RELEASE_NAMESPACE,
                "image_pull_policy": launcher["imagePullPolicy"],
                "service_account_name": fullname,
                "dagster_home": values["global"]["dagsterHome"],
                "instance_config_map": f"{fullname}-instance",
                "postgres_password_secret": values["global"]["postgresqlSecretName"],
                "env_config_maps": names(launcher["envConfigMaps"]),
                "env_secrets": names(launcher["envSecrets"]),
                **{key: value for key, value in optional_launcher_lists.items() if value},
                "resources": launcher["resources"],
                "security_context": launcher["securityContext"],
                **({"run_k8s_config": run_k8s_config} if run_k8s_config else {}),
            },
        },
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": "QueuedRunCoordinator",
        },
        "compute_logs": {
            "module": "dagster.core.storage.noop_compute_log_manager",
            "class": "NoOpComputeLogManager",
        },
        "run_monitoring": snake_keys(daemon["runMonitoring"]),
        **run_retries,
        "telemetry": {"enabled": values["telemetry"]["enabled"]},
        "retention": {
            kind: {"purge_after_days": retention[kind]["purgeAfterDays"]}
            for kind in ("sensor", "schedule")
        },
        "concurrency": {
            "pools": snake_keys(concurrency["pools"]),
            "runs": snake_keys(concurrency["runs"]),
        },
    }
    for daemon_part in ("sensors", "schedules"):
        if daemon[daemon_part]["useThreads"]:
            rendered[daemon_part] = snake_keys(daemon[daemon_part])
    return rendered


def repository_instance(values: Mapping[str, Any]) -> Config:
    """The repository's dagster.yaml as `pin serve` installs it, with the drain runs' limit from
    the PIN_RECALC_MAX_DRAIN_RUNS the values give the code server."""
    drain_runs = code_server(values)["env"]["PIN_RECALC_MAX_DRAIN_RUNS"]
    return instance_config(Settings.from_env({"PIN_RECALC_MAX_DRAIN_RUNS": drain_runs}))


def shared_sections(config: Mapping[str, Any]) -> Config:
    """The SHARED_SECTIONS of an instance config with Dagster's defaults filled in, so a default
    written out (`max_retries: 0`) equals one left out, and the run queue's tag limits in one
    order (the queue applies them all)."""
    # A section left out is Dagster's default (the chart writes no `run_retries:` when off).
    subset = {name: config.get(name, {}) for name in SHARED_SECTIONS}
    result = process_config(Shape(dagster_instance_config_schema()), subset)
    assert result.success, result.errors
    assert result.value is not None
    limits = result.value["concurrency"]["runs"]["tag_concurrency_limits"]
    limits.sort(key=lambda limit: (limit["key"], limit.get("value") or ""))
    return {name: result.value[name] for name in subset}


def test_the_kubernetes_instance_passes_dagsters_validation() -> None:
    """deploy/k8s/dagster.yaml through `dagster_instance_config` (the loader DagsterInstance
    uses) and each class's own config schema; the run launcher is dagster-k8s' K8sRunLauncher
    and the coordinator the QueuedRunCoordinator."""
    config = validated_instance(K8S_DIR)

    assert set(CLASS_SECTIONS) <= set(config)
    assert issubclass(configured_class(config["run_launcher"]), K8sRunLauncher)
    assert issubclass(configured_class(config["run_coordinator"]), QueuedRunCoordinator)


def rename(*path: str, old: str, new: str) -> Callable[[Config], None]:
    def mutate(config: Config) -> None:
        parent = reduce(lambda node, key: node[key], path, config)
        parent[new] = parent.pop(old)

    return mutate


def set_value(*path: str, key: str, value: object) -> Callable[[Config], None]:
    def mutate(config: Config) -> None:
        reduce(lambda node, part: node[part], path, config)[key] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "reported"),
    [
        pytest.param(rename(old="retention", new="retension"), "retension", id="top-level"),
        pytest.param(
            rename("run_monitoring", old="poll_interval_seconds", new="poll_interval_second"),
            "poll_interval_second",
            id="run_monitoring",
        ),
        pytest.param(
            rename("concurrency", "runs", old="tag_concurrency_limits", new="tag_limits"),
            "tag_limits",
            id="run-queue-limits",
        ),
        pytest.param(
            set_value("concurrency", "pools", key="granularity", value="ops"),
            "granularity",
            id="pool-granularity",
        ),
        pytest.param(
            rename("run_launcher", "config", old="env_config_maps", new="env_configmaps"),
            "env_configmaps",
            id="k8s-run-launcher",
        ),
        pytest.param(
            rename("run_storage", "config", "postgres_db", old="hostname", new="host"),
            "host",
            id="postgres-storage",
        ),
        pytest.param(
            set_value("run_coordinator", key="config", value={"max_concurrent_run": 6}),
            "max_concurrent_run",
            id="queued-run-coordinator",
        ),
    ],
)
def test_a_broken_key_fails_dagsters_validation(
    tmp_path: Path, mutate: Callable[[Config], None], reported: str
) -> None:
    """The shipped file with one key misspelt (or one value wrong) in a copy: the validation above
    raises DagsterInvalidConfigError naming it. The unchanged copy passes, so the failure is the
    mutation's."""
    config = load_yaml(INSTANCE)
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(config))
    validated_instance(tmp_path)

    mutate(config)
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(DagsterInvalidConfigError) as failure:
        validated_instance(tmp_path)
    assert reported in str(failure.value)


def test_the_helm_values_render_the_kubernetes_instance() -> None:
    """Every section of deploy/k8s/dagster.yaml equals what the chart writes for
    deploy/helm/values.yaml, and it holds no other section."""
    assert load_yaml(INSTANCE) == chart_instance(load_yaml(VALUES))


def test_the_kubernetes_instance_keeps_the_repository_limits() -> None:
    """Run queue limits (the drain limit included), pools, retries, telemetry and tick retention
    equal the repository's instance, defaults filled in; run monitoring keeps every repository
    value (Kubernetes adds settings the local instance does not need); same coordinator."""
    values = load_yaml(VALUES)
    repository = repository_instance(values)
    kubernetes = load_yaml(INSTANCE)

    assert shared_sections(kubernetes) == shared_sections(repository)
    assert repository["run_monitoring"].items() <= kubernetes["run_monitoring"].items()
    assert configured_class(repository["run_coordinator"]) is configured_class(
        kubernetes["run_coordinator"]
    )
    drain = {"key": "pin/job", "value": "recalc_drain"}
    (drain_limit,) = [
        limit["limit"]
        for limit in kubernetes["concurrency"]["runs"]["tag_concurrency_limits"]
        if limit.items() >= drain.items()
    ]
    assert drain_limit == int(code_server(values)["env"]["PIN_RECALC_MAX_DRAIN_RUNS"])


def config_maps(refs: Iterable[str], extra: Iterable[Config] = ()) -> Config:
    """The settings the named ConfigMaps give a pod, later ones winning as in `envFrom`; the
    example manifest's and `extra`'s ConfigMaps."""
    by_name = {
        doc["metadata"]["name"]: doc["data"]
        for doc in [*yaml.safe_load_all(ENV_MANIFEST.read_text()), *extra]
        if doc["kind"] == "ConfigMap"
    }
    settings: Config = {}
    for name in refs:
        settings |= by_name[name]
    return settings


def assert_tls_clickhouse_server(url: str) -> None:
    """A ClickHouse server (never the embedded engine: one process per folder) over the native
    protocol with TLS, the server's certificate verified against a CA file, no password in it."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    assert parts.scheme == "clickhouses", url
    assert parts.hostname not in LOOPBACK_HOSTS and parts.username and parts.password is None
    assert parts.path.strip("/") == CLICKHOUSE_DATABASE
    assert query["verify"] == ["true"] and query["ca_certs"][0].startswith("/"), url


def test_the_code_server_and_the_runs_get_the_contract_settings() -> None:
    """The code server (sensors) and the run workers draw on the same ConfigMap and Secret; the
    example manifest defines the ConfigMap, with no credential in it; together with the values'
    env it makes valid Settings pointing at external services over TLS, ClickHouse as a server;
    Dagster's storage password is a Secret the operator is told to create, with the chart's
    key."""
    values = load_yaml(VALUES)
    server = code_server(values)
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]

    assert names(server["envConfigMaps"]) == names(launcher["envConfigMaps"])
    assert names(server["envSecrets"]) == names(launcher["envSecrets"])
    settings_map = config_maps(names(server["envConfigMaps"]))
    assert {"PIN_PG_DSN", "PIN_CLICKHOUSE_URL", "PIN_KAFKA_BOOTSTRAP"} <= settings_map.keys()

    settings = Settings.from_env({**settings_map, **server["env"]})
    assert_tls_clickhouse_server(settings.clickhouse_url)
    assert not settings.pg.is_local
    assert parse_qs(urlsplit(settings.pg_dsn).query)["sslmode"] == ["verify-full"]
    assert not settings.kafka_is_local
    assert operator_secrets()[values["global"]["postgresqlSecretName"]] == {"postgresql-password"}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.partition(" ") for line in lines if line and line[0] != "#")
    ]


def test_the_image_serves_the_code_location() -> None:
    """deploy/Dockerfile: python:3.11-slim, the checkout installed editable with the k8s extra, a
    non-root user, and a CMD serving `pin_pipelines.definitions` (the module pyproject.toml,
    workspace.yaml and the values' dagsterApiGrpcArgs name) on the port it exposes and the values
    give; .dockerignore keeps the local state out and everything the image copies in."""
    instructions = dockerfile_instructions()
    by_word: dict[str, list[str]] = {}
    for word, args in instructions:
        by_word.setdefault(word, []).append(args)
    command = json.loads(by_word["CMD"][-1])
    server = code_server(load_yaml(VALUES))
    module = command[command.index("-m") + 1]
    port = int(command[command.index("-p") + 1])
    workspace = load_yaml(REPO / "workspace.yaml")["load_from"][0]["python_module"]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())

    assert by_word["FROM"] == ["python:3.11-slim"]
    # `dagster api grpc`, as `pin serve` runs it: the process that loads the code is the
    # container's, not a proxy's child that nothing restarts.
    assert command[:3] == ["dagster", "api", "grpc"]
    assert module == "pin_pipelines.definitions"
    assert module == pyproject["tool"]["dagster"]["module_name"] == workspace["module_name"]
    assert importlib.util.find_spec(module) is not None
    assert server["dagsterApiGrpcArgs"] == ["-m", module]
    assert "codeServerArgs" not in server
    assert port == server["port"] == int(by_word["EXPOSE"][-1])
    assert by_word["USER"][-1] not in ("root", "0")
    assert any('pip install --editable ".[k8s]"' in run for run in by_word["RUN"])

    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    ignored = [line for line in lines if line and not line.startswith("#")]
    assert {".git", ".pin", ".venv"} <= set(ignored)
    copied = [source for args in by_word["COPY"] for source in args.split()[:-1]]
    for source in copied:
        path = source.rstrip("/")
        assert (REPO / path).exists(), f"COPY {source}: no such file in the repository"
        assert not any(fnmatch.fnmatch(path, pattern) for pattern in ignored), source


def test_the_chart_and_the_images_move_with_the_dagster_pin() -> None:
    """The chart version the values install and the webserver/daemon image tags are the pinned
    Dagster release; dagster-k8s is pinned with the rest of the family and is what is
    installed."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [*pyproject["dependencies"], *pyproject["optional-dependencies"]["k8s"]]
    pins = dict(req.split("==") for req in requirements if "==" in req)
    values_text = VALUES.read_text()
    values = yaml.safe_load(values_text)

    assert pins["dagster"] == dagster.__version__
    assert pins["dagster-k8s"] == pins["dagster-postgres"]
    assert importlib.metadata.version("dagster-k8s") == pins["dagster-k8s"]
    assert re.findall(r"chart version (\S+):", values_text) == [pins["dagster"]]
    assert re.findall(r"--version (\S+)", values_text) == [pins["dagster"]]
    for part in ("dagsterWebserver", "dagsterDaemon"):
        assert values[part]["image"]["tag"] == pins["dagster"]


# --- the read API ---------------------------------------------------------------------------------

#: The Kubernetes client's model of each kind the API's manifest holds.
API_KINDS = {"ConfigMap": "V1ConfigMap", "Deployment": "V1Deployment", "Service": "V1Service"}
_PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "object": (object,),  # IntOrString and free-form fields
}


def k8s_model(model: str, data: Any, where: str = "") -> Any:
    """`data` (a manifest's mapping, camelCase keys) as the `kubernetes` client's model named
    `model` (its OpenAPI type name: `V1Deployment`, `list[V1Container]`, `dict[str, str]`),
    recursively: a key the model does not have, a value of the wrong type, or a required field
    missing (the client's own validation) raises, naming where."""
    import kubernetes.client as k8s

    if model.startswith("list["):
        assert isinstance(data, list), f"{where}: a list expected"
        return [k8s_model(model[5:-1], item, f"{where}[{n}]") for n, item in enumerate(data)]
    if model.startswith(("dict(", "dict[")):
        assert isinstance(data, dict), f"{where}: a mapping expected"
        value_model = model[model.index(",") + 1 : -1].strip()
        return {key: k8s_model(value_model, value, f"{where}.{key}") for key, value in data.items()}
    if model in _PRIMITIVES:
        wrong_int = model == "int" and isinstance(data, bool)
        assert isinstance(data, _PRIMITIVES[model]) and not wrong_int, f"{where}: {model}"
        return data
    klass = getattr(k8s, model)
    assert isinstance(data, dict), f"{where}: a mapping expected for {model}"
    by_key = {key: attr for attr, key in klass.attribute_map.items()}
    unknown = sorted(set(data) - set(by_key))
    assert not unknown, f"{where}: {model} has no {unknown}"
    return klass(
        **{
            by_key[key]: k8s_model(klass.openapi_types[by_key[key]], value, f"{where}.{key}")
            for key, value in data.items()
        }
    )


def api_manifests() -> dict[str, Config]:
    """The API's manifest by kind (one object of each)."""
    found: dict[str, Config] = {}
    for doc in yaml.safe_load_all(API_MANIFEST.read_text()):
        assert doc["kind"] not in found, doc["kind"]
        found[doc["kind"]] = doc
    return found


def test_the_api_manifests_are_kubernetes_objects() -> None:
    """Each object of deploy/k8s/dev-stats-api.yaml builds as the Kubernetes client's model of
    its kind, every key known; a misspelt key in a copy fails, naming it."""
    manifests = api_manifests()
    assert set(manifests) == set(API_KINDS)
    for kind, doc in manifests.items():
        k8s_model(API_KINDS[kind], doc, kind)

    broken = api_manifests()["Deployment"]
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(AssertionError, match="readinesProbe"):
        k8s_model("V1Deployment", broken, "Deployment")
    broken = api_manifests()["Service"]
    broken["spec"]["ports"][0]["port"] = "8090"
    with pytest.raises(AssertionError, match="port"):
        k8s_model("V1Service", broken, "Service")


def test_the_api_pods_serve_the_contract_on_their_service() -> None:
    """`pin api serve` (a command the CLI has) in the code server's image, non-root as the
    image's user; the Service's selector picks the pods and its target ports are the
    container's: `http`, on which the API listens (all interfaces) and the probes ask (/healthz
    for readiness, the ClickHouse-free /openapi.json for liveness), and `metrics`, the API's
    metrics listener, where Prometheus scrapes /metrics (never the API's port: every path there
    needs a token); a stop gets more time than the API's graceful stop; the settings the pod is
    given are valid for the API against a ClickHouse server."""
    from pin_pipelines.api.server import GRACEFUL_SECONDS
    from pin_pipelines.cli import build_parser

    manifests = api_manifests()
    deployment, service, api_config = (
        manifests[kind] for kind in ("Deployment", "Service", "ConfigMap")
    )
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port, metrics_port = (
        next(p for p in container["ports"] if p["name"] == name) for name in ("http", "metrics")
    )
    assert len(container["ports"]) == 2
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(service_ports) == {"http", "metrics"}
    server = code_server(load_yaml(VALUES))
    env = {item["name"]: item["value"] for item in container["env"]}

    assert container["command"] == ["pin", "api", "serve"]
    assert build_parser().parse_args(container["command"][1:]).handler.__name__ == "cmd_api_serve"
    assert container["image"] == f"{server['image']['repository']}:{server['image']['tag']}"
    dockerfile_user = [args for word, args in dockerfile_instructions() if word == "USER"][-1]
    assert pod["spec"]["securityContext"]["runAsUser"] == int(dockerfile_user)
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True

    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    for name, target in (("http", port), ("metrics", metrics_port)):
        assert service_ports[name]["targetPort"] in (target["name"], target["containerPort"])
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/openapi.json", "port": port["name"]}
    scrape = pod["metadata"]["annotations"]
    assert (scrape["prometheus.io/port"], scrape["prometheus.io/path"]) == (
        str(metrics_port["containerPort"]),
        "/metrics",
    )
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > (
        GRACEFUL_SECONDS
    )

    config_map_names = [s["configMapRef"]["name"] for s in container["envFrom"]]
    given = config_maps(config_map_names, [api_config])
    assert names(server["envConfigMaps"])[0] in config_map_names
    settings = Settings.from_env({**given, **env})
    assert_tls_clickhouse_server(settings.clickhouse_url)
    assert (settings.api_addr, settings.api_port, settings.api_metrics_port) == (
        "0.0.0.0",
        port["containerPort"],
        metrics_port["containerPort"],
    )
    assert settings.api_jwks_url and settings.api_jwks_url.startswith("https://")
    assert settings.api_issuer and settings.api_audience


# --- credentials: Kubernetes Secrets only (CONTRACT section 8) --------------------------------

#: `://user:password@` in a URL, anywhere in a file (comments included).
URL_WITH_PASSWORD = re.compile(r"://[^/\s:@]*:[^/\s@]*@")
#: Keys (or env entries' names) that would hold a credential.
CREDENTIAL_KEY = re.compile(r"pass(word|wd)?|secret|token|credential|api_?key|private_?key", re.I)
#: The settings naming a file; PostgreSQL's and ClickHouse's URL parameters naming one.
FILE_SETTINGS = ("PIN_KAFKA_CONFIG", "PIN_CLICKHOUSE_PASSWORD_FILE")
PG_FILE_PARAMS = ("sslrootcert", "sslcert", "sslkey", "passfile")
CLICKHOUSE_FILE_PARAMS = ("ca_certs", "certfile", "keyfile")
#: The PostgreSQL role of a pod, as libpq's environment (the DSN names neither).
PG_ROLE_KEYS = {"PGUSER", "PGPASSWORD"}


def operator_secrets() -> dict[str, set[str]]:
    """The Secrets the example manifest's comments tell the operator to create, name → keys,
    read from its `kubectl ... create secret generic NAME --from-file=KEY=... --from-literal=
    KEY=...` commands (continuation lines joined)."""
    lines = ENV_MANIFEST.read_text().splitlines()
    comments = "\n".join(line.strip()[1:] for line in lines if line.strip().startswith("#"))
    commands = re.sub(r"\\\n", " ", comments)
    return {
        match[1]: set(re.findall(r"--from-(?:file|literal)=([^=\s]+)=", match[2]))
        for match in re.finditer(
            r"kubectl .*create secret generic ([a-z0-9][a-z0-9-]*)(.*)", commands
        )
    }


def deploy_yaml_files() -> list[Path]:
    return sorted((REPO / "deploy").rglob("*.yaml"))


def credential_findings(text: str, references: set[str]) -> list[str]:
    """What in one YAML file looks like a credential: a URL with a password (comments included),
    a Secret with `data`/`stringData`, a credential-like key (or env entry) with a literal value
    that is neither a Secret name in `references` nor a file path."""
    found = [f"URL with a password: {m[0]}" for m in URL_WITH_PASSWORD.finditer(text)]

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if node.get("kind") == "Secret" and {"data", "stringData"} & node.keys():
                found.append(f"{where}: a Secret with data")
            for key, value in node.items():
                named = str(node.get("name")) if key == "value" else str(key)
                literal = isinstance(value, (str, int, float)) and not isinstance(value, bool)
                reference = isinstance(value, str) and (value in references or value[:1] == "/")
                if CREDENTIAL_KEY.search(named) and literal and not reference:
                    found.append(f"{where}.{key}: a literal {named}")
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for n, item in enumerate(node):
                walk(item, f"{where}[{n}]")

    for n, doc in enumerate(yaml.safe_load_all(text)):
        walk(doc, f"document {n}")
    return found


def test_no_file_under_deploy_holds_a_credential() -> None:
    """Every YAML file under deploy/ (values, instance config, manifests) is free of Secrets with
    data, URLs with a password and literal password-like values; the scan itself catches each of
    those when one is put into a copy of the example manifest."""
    references = set(operator_secrets())
    for path in deploy_yaml_files():
        assert credential_findings(path.read_text(), references) == [], path

    clean = ENV_MANIFEST.read_text()
    planted = {
        "Secret with data": "---\nkind: Secret\nmetadata: {name: x}\nstringData: {a: b}\n",
        "URL with a password": "---\nkind: ConfigMap\ndata: {U: 'postgresql://pin:hunter2@db/pin'}\n",
        "literal password": "---\nkind: ConfigMap\ndata: {PGPASSWORD: hunter2}\n",
        "literal PGPASSWORD": "---\nenv: [{name: PGPASSWORD, value: hunter2}]\n",
        "literal password key": "---\npostgresql: {postgresqlPassword: hunter2}\n",
    }
    for what, extra in planted.items():
        assert credential_findings(clean + extra, references), what


@dataclass(frozen=True)
class ProjectPod:
    """A pod running project code, as far as its credentials go."""

    name: str
    settings: Config
    env_secrets: list[str]
    volumes: list[Config]
    mounts: list[Config]
    fs_group: int | None


def project_pods() -> dict[str, ProjectPod]:
    """The code server (values), the run workers (the instance config the launcher reads, equal
    to the values), the read API and the migrate Job (their manifests)."""
    values = load_yaml(VALUES)
    server = code_server(values)
    launcher = load_yaml(INSTANCE)["run_launcher"]["config"]
    pods = {
        "code server": ProjectPod(
            "code server",
            {**config_maps(names(server["envConfigMaps"])), **server["env"]},
            names(server["envSecrets"]),
            server["volumes"],
            server["volumeMounts"],
            server["podSecurityContext"].get("fsGroup"),
        ),
        "run worker": ProjectPod(
            "run worker",
            config_maps(launcher["env_config_maps"]),
            launcher["env_secrets"],
            launcher["volumes"],
            launcher["volume_mounts"],
            launcher["run_k8s_config"]["pod_spec_config"]["securityContext"].get("fsGroup"),
        ),
    }
    api_config = api_manifests()["ConfigMap"]
    for name, template in (
        ("read API", api_manifests()["Deployment"]["spec"]["template"]),
        ("migrate Job", load_yaml(MIGRATE_MANIFEST)["spec"]["template"]),
    ):
        (container,) = template["spec"]["containers"]
        refs = container["envFrom"]
        env = {item["name"]: item["value"] for item in container.get("env", [])}
        pods[name] = ProjectPod(
            name,
            {
                **config_maps(
                    [r["configMapRef"]["name"] for r in refs if "configMapRef" in r], [api_config]
                ),
                **env,
            },
            [r["secretRef"]["name"] for r in refs if "secretRef" in r],
            template["spec"]["volumes"],
            container["volumeMounts"],
            template["spec"]["securityContext"].get("fsGroup"),
        )
    return pods


def secret_file_paths(settings: Mapping[str, str], *, clickhouse_only: bool) -> list[str]:
    """Every file a pod's settings name: PIN_KAFKA_CONFIG, PIN_CLICKHOUSE_PASSWORD_FILE and the
    file parameters of PIN_PG_DSN and PIN_CLICKHOUSE_URL (only ClickHouse's for the read API,
    which uses nothing else)."""
    pg = parse_qs(urlsplit(settings["PIN_PG_DSN"]).query)
    clickhouse = parse_qs(urlsplit(settings["PIN_CLICKHOUSE_URL"]).query)
    paths = [settings["PIN_CLICKHOUSE_PASSWORD_FILE"]]
    paths += [value for key in CLICKHOUSE_FILE_PARAMS for value in clickhouse.get(key, [])]
    if not clickhouse_only:
        paths.append(settings["PIN_KAFKA_CONFIG"])
        paths += [value for key in PG_FILE_PARAMS for value in pg.get(key, [])]
    return paths


def test_every_project_pod_mounts_the_secrets_its_settings_name() -> None:
    """For the code server, the run workers, the read API and the migrate Job: each file the
    settings name lies in a mounted volume (a whole Secret, no subPath, so a rotation reaches the
    running pod) whose Secret the operator is told to create with that file as a key; the
    volumes and mounts are valid Kubernetes objects; the files are read-only, group-readable
    through the pod's fsGroup, and only the CA is readable by others. PostgreSQL's role comes
    from PGUSER/PGPASSWORD (libpq ignores a group-readable passfile): `pin-postgres` for the
    workers, `pin-postgres-owner` for the migrate Job alone, nothing for the read API."""
    secrets = operator_secrets()
    pods = project_pods()
    assert set(pods) == {"code server", "run worker", "read API", "migrate Job"}
    for pod in pods.values():
        k8s_model("list[V1Volume]", pod.volumes, pod.name)
        k8s_model("list[V1VolumeMount]", pod.mounts, pod.name)
        volumes = {volume["name"]: volume for volume in pod.volumes}
        assert pod.fs_group is not None, pod.name
        for mount in pod.mounts:
            assert "subPath" not in mount and "subPathExpr" not in mount, (pod.name, mount)
        paths = secret_file_paths(pod.settings, clickhouse_only=pod.name == "read API")
        for path in paths:
            folder = PurePosixPath(path).parent
            holding = [m for m in pod.mounts if PurePosixPath(m["mountPath"]) == folder]
            assert len(holding) == 1, f"{pod.name}: no volume mounted at {folder} for {path}"
            (mount,) = holding
            secret = volumes[mount["name"]]["secret"]
            assert "items" not in secret, (pod.name, secret)
            assert PurePosixPath(path).name in secrets[secret["secretName"]], (pod.name, path)
            assert mount.get("readOnly") is True, (pod.name, mount)
            mode = secret["defaultMode"]
            assert mode & 0o333 == 0 and mode & 0o040, (pod.name, oct(mode))
            if secrets[secret["secretName"]] != {"ca.crt"}:
                assert mode & 0o007 == 0, (pod.name, secret["secretName"], oct(mode))

        pg = urlsplit(pod.settings["PIN_PG_DSN"])
        assert pg.username is None and pg.password is None, pod.name
        Settings.from_env(pod.settings)
        assert_tls_clickhouse_server(pod.settings["PIN_CLICKHOUSE_URL"])
        expected = {
            "code server": ["pin-postgres"],
            "run worker": ["pin-postgres"],
            "migrate Job": ["pin-postgres-owner"],
            "read API": [],
        }[pod.name]
        assert pod.env_secrets == expected, pod.name
        for name in expected:
            assert secrets[name] == PG_ROLE_KEYS, name

    values = load_yaml(VALUES)
    assert secrets[values["global"]["postgresqlSecretName"]] == {"postgresql-password"}
    api_user = urlsplit(pods["read API"].settings["PIN_CLICKHOUSE_URL"]).username
    assert api_user != urlsplit(pods["code server"].settings["PIN_CLICKHOUSE_URL"]).username


def test_the_migrate_job_runs_pin_db_migrate_in_the_code_servers_image() -> None:
    """deploy/k8s/pin-db-migrate.yaml builds as a Kubernetes Job (every key known) running
    `pin db migrate` (a command the CLI has) in the code server's image, never restarted in
    place, as the image's non-root user."""
    from pin_pipelines.cli import build_parser

    job = load_yaml(MIGRATE_MANIFEST)
    k8s_model("V1Job", job, "Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    server = code_server(load_yaml(VALUES))
    dockerfile_user = [args for word, args in dockerfile_instructions() if word == "USER"][-1]

    assert container["command"] == ["pin", "db", "migrate"]
    assert build_parser().parse_args(container["command"][1:]).handler.__name__ == "cmd_db_migrate"
    assert container["image"] == f"{server['image']['repository']}:{server['image']['tag']}"
    assert pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsUser"] == int(dockerfile_user)
