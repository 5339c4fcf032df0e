"""A secured single-node Kafka on loopback (`pin stack up --secure`, the tests of contract
section 8): the managed services' shapes on one KRaft node of stack/kafka.py.

Listeners (all on free loopback ports, kept in `ports.json` so `up` is idempotent):
- PLAINTEXT (inter-broker, and this module's own admin calls) and CONTROLLER, as every node has;
- `scram`: SASL_SSL with SCRAM-SHA-512 and SCRAM-SHA-256 (Amazon MSK, Redpanda, Aiven);
- `plain`: SASL_SSL with PLAIN (Confluent Cloud's API key and secret);
- `mtls`: SSL requiring a client certificate signed by the local CA, the principal its CN (Aiven).

The server certificate comes from the local CA (stack/tls.py) and names localhost/127.0.0.1, so
librdkafka's default hostname check holds. Passwords are generated once into 0600 files under
the folder; `client_properties(kind)` writes the PIN_KAFKA_CONFIG file of one client kind.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialAlteration,
    UserScramCredentialUpsertion,
)

from pin_pipelines.errors import PinError
from pin_pipelines.kafka import admin
from pin_pipelines.stack.kafka import (
    HEAP,
    KAFKA_VERSION,
    SINGLE_NODE_CONFIG,
    KafkaNode,
    Listener,
    fetch_jars,
    new_cluster_id,
)
from pin_pipelines.stack.process import free_port_run, read_pid, stop_pid, wait_until
from pin_pipelines.stack.tls import LocalCA

USER = "pin"
#: Client kinds → (listener, SASL mechanism or None for a client certificate).
CLIENTS = {
    "scram-sha-512": ("scram", "SCRAM-SHA-512"),
    "scram-sha-256": ("scram", "SCRAM-SHA-256"),
    "plain": ("plain", "PLAIN"),
    "mtls": ("mtls", None),
}
_PROTOCOLS = {"scram": "SASL_SSL", "plain": "SASL_SSL", "mtls": "SSL"}
#: Salted-hash iterations of a SCRAM credential (Kafka's minimum 4096).
SCRAM_ITERATIONS = 8192
#: This module's own admin calls go to the plaintext (inter-broker) listener, whatever the
#: process's PIN_KAFKA_CONFIG says: the SASL and TLS properties are ignored under PLAINTEXT.
_PLAINTEXT = {"security.protocol": "PLAINTEXT"}


class SecureKafka:
    """One secured KRaft node under `folder`; `libs` may be the jars of another broker."""

    def __init__(self, folder: Path, libs: Path | None = None, ca: LocalCA | None = None) -> None:
        self.folder = folder
        self.libs = libs or folder / f"libs-{KAFKA_VERSION}"
        #: Its own CA unless given the estate's (`pin stack up --secure`: one CA for all).
        self.ca = ca or LocalCA(folder / "tls")
        self.clients = folder / "clients"

    # -- the node ------------------------------------------------------------------------------

    def _ports(self) -> dict[str, int]:
        """plaintext, controller, scram, plain, mtls: chosen once, then read back."""
        path = self.folder / "ports.json"
        if not path.exists():
            # `pin stack down --secure` or `status` after an `up` that stopped before Kafka
            # asks for the ports too: the folder may not be there yet.
            path.parent.mkdir(parents=True, exist_ok=True)
            base = free_port_run(5)
            names = ("plaintext", "controller", *_PROTOCOLS)
            path.write_text(json.dumps({n: base + i for i, n in enumerate(names)}))
        ports: dict[str, int] = json.loads(path.read_text())
        return ports

    @property
    def node(self) -> KafkaNode:
        ports = self._ports()
        listeners = tuple(Listener(name.upper(), p, ports[name]) for name, p in _PROTOCOLS.items())
        return KafkaNode(
            self.folder / "node", self.libs, 1, ports["plaintext"], ports["controller"], listeners
        )

    def bootstrap(self, listener: str) -> str:
        """The address of `listener` (scram, plain, mtls, plaintext) or of a client kind's."""
        name = CLIENTS[listener][0] if listener in CLIENTS else listener
        return f"127.0.0.1:{self._ports()[name]}"

    def password(self, name: str) -> str:
        """A generated password (keystore, scram, plain), made once into a 0600 file."""
        path = self.folder / "secrets" / f"{name}.password"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text(secrets.token_hex(16))
        return path.read_text().strip()

    def _config(self) -> str:
        """Broker settings: a PKCS12 keystore from the local CA for every TLS listener, SCRAM
        and PLAIN per listener, client certificates required on `mtls` (PEM truststore)."""
        keystore_password = self.password("keystore")
        keystore = self.ca.pkcs12(self.ca.issue("kafka-broker"), keystore_password)
        scram_login = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        plain_login = (
            "org.apache.kafka.common.security.plain.PlainLoginModule required"
            f' user_{USER}="{self.password("plain")}";'
        )
        return SINGLE_NODE_CONFIG + (
            "ssl.keystore.type=PKCS12\n"
            f"ssl.keystore.location={keystore}\n"
            f"ssl.keystore.password={keystore_password}\n"
            f"ssl.key.password={keystore_password}\n"
            "listener.name.scram.sasl.enabled.mechanisms=SCRAM-SHA-512,SCRAM-SHA-256\n"
            f"listener.name.scram.scram-sha-512.sasl.jaas.config={scram_login}\n"
            f"listener.name.scram.scram-sha-256.sasl.jaas.config={scram_login}\n"
            "listener.name.plain.sasl.enabled.mechanisms=PLAIN\n"
            f"listener.name.plain.plain.sasl.jaas.config={plain_login}\n"
            "listener.name.mtls.ssl.client.auth=required\n"
            "listener.name.mtls.ssl.truststore.type=PEM\n"
            f"listener.name.mtls.ssl.truststore.location={self.ca.cert}\n"
            "ssl.principal.mapping.rules=RULE:^CN=([^,]+).*$/$1/,DEFAULT\n"
        )

    def up(self) -> dict[str, object]:
        """Start the node unless it runs; returns once its client listeners answer."""
        started = time.monotonic()
        fetch_jars(self.libs)
        self.folder.mkdir(parents=True, exist_ok=True)
        node = self.node
        config = self._config()
        users = [
            f"{mechanism}=[name={USER},password={self.password('scram')}]"
            for mechanism in ("SCRAM-SHA-512", "SCRAM-SHA-256")
        ]
        pid, fresh = node.start(
            voters=f"1@127.0.0.1:{node.controller_port}",
            cluster_id=new_cluster_id(),
            config=config,
            heap=HEAP,
            format_args=tuple(arg for user in users for arg in ("--add-scram", user)),
        )
        (node.home / "server.properties").chmod(0o600)  # the keystore and PLAIN passwords
        wait_until(
            self._answers,
            timeout=90,
            what="the secured Kafka",
            logfile=node.logfile,
            pid=pid,
            output=node.output,
        )
        return {
            **self.status(),
            "state": "started" if fresh else "already running",
            "ready_seconds": round(time.monotonic() - started, 2),
        }

    def _answers(self) -> bool:
        try:
            admin(self.bootstrap("plaintext"), _PLAINTEXT).list_topics(timeout=1.0)
        except KafkaException:
            return False
        return True

    def down(self) -> dict[str, object]:
        stop_pid(self.node.pidfile, grace_seconds=30)
        return {"service": "kafka-secure", "state": "stopped"}

    def status(self) -> dict[str, object]:
        pid = read_pid(self.node.pidfile)
        state = "down" if pid is None else ("running" if self._answers() else "starting")
        return {
            "service": "kafka-secure",
            "managed": True,
            "state": state,
            "pid": pid,
            "version": KAFKA_VERSION,
            "bootstrap": {name: self.bootstrap(name) for name in _PROTOCOLS},
            "client_properties": {
                kind: str(self.clients / f"{kind}.properties") for kind in CLIENTS
            },
        }

    # -- clients -------------------------------------------------------------------------------

    def client_properties(self, kind: str) -> Path:
        """Write the PIN_KAFKA_CONFIG file of a client of `kind` (scram-sha-512, scram-sha-256,
        plain, mtls) with the current password; 0600, it holds the secret."""
        listener, mechanism = CLIENTS[kind]
        lines = [f"security.protocol={_PROTOCOLS[listener]}", f"ssl.ca.location={self.ca.cert}"]
        if mechanism is None:
            issued = self.ca.issue(USER, client=True)
            lines += [f"ssl.certificate.location={issued.cert}", f"ssl.key.location={issued.key}"]
        else:
            secret = self.password("plain" if mechanism == "PLAIN" else "scram")
            lines += [f"sasl.mechanism={mechanism}", f"sasl.username={USER}"]
            lines += [f"sasl.password={secret}"]
        path = self.clients / f"{kind}.properties"
        self.clients.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text("# Written by pin_pipelines.stack.secure_kafka\n" + "\n".join(lines) + "\n")
        return path

    def rotate_scram_password(self) -> str:
        """A new SCRAM password for both mechanisms, on the running broker (the admin API, as
        `kafka-configs --alter --add-config 'SCRAM-SHA-512=[password=…]'`) and in its file.
        Existing connections stay; new ones need the new password. Returns the file's path."""
        new = secrets.token_hex(16)
        client = admin(self.bootstrap("plaintext"), _PLAINTEXT)
        # One credential per request: the broker refuses a user altered twice in one.
        for mechanism in (ScramMechanism.SCRAM_SHA_512, ScramMechanism.SCRAM_SHA_256):
            upsert: list[UserScramCredentialAlteration] = [
                UserScramCredentialUpsertion(
                    USER, ScramCredentialInfo(mechanism, SCRAM_ITERATIONS), new.encode()
                )
            ]
            for future in client.alter_user_scram_credentials(upsert).values():
                try:
                    future.result(timeout=30)
                except KafkaException as exc:
                    raise PinError(f"rotating the SCRAM password of {USER} failed: {exc}") from exc
        path = self.folder / "secrets" / "scram.password"
        path.write_text(new)
        return str(path)
