"""PIN_KAFKA_CONFIG checked before anything is touched (contract section 8): no broker needed,
librdkafka judges the properties without connecting."""

from __future__ import annotations

from pathlib import Path

import pytest

from pin_pipelines.cli import main
from pin_pipelines.errors import PinError
from pin_pipelines.kafka import client_config
from pin_pipelines.kafka_properties import (
    ENV,
    REQUIRES_TLS,
    Causes,
    operator_cause,
    read_properties,
)

SECRET = "s3cr3t-Pa55word"


def properties(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "client.properties"
    path.write_text(text)
    return path


def refusal(path: Path) -> str:
    with pytest.raises(PinError) as caught:
        read_properties({ENV: str(path)})
    message = str(caught.value)
    assert "\n" not in message and SECRET not in message, message
    return message


def test_a_file_of_comments_keys_and_blank_lines_reaches_every_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Comments, blank lines, spaces around `=`, a value holding `=`: the client's config is
    bootstrap.servers, the file's properties, then the client's own settings."""
    path = properties(
        tmp_path,
        "# Confluent Cloud\n\nsecurity.protocol = SASL_SSL\nsasl.mechanism=PLAIN\n"
        f"sasl.username=KEY\nsasl.password={SECRET}==\n",
    )
    monkeypatch.setenv(ENV, str(path))
    config = client_config("broker:9092", {"acks": "all"})
    assert config["bootstrap.servers"] == "broker:9092"
    assert config["security.protocol"] == "SASL_SSL"
    assert config["sasl.password"] == f"{SECRET}=="
    assert config["acks"] == "all"


def test_unset_means_plaintext_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert "security.protocol" not in client_config("127.0.0.1:9092")


def test_the_file_is_read_again_for_every_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotated file counts from the next client: nothing is cached."""
    path = properties(tmp_path, "sasl.username=old\n")
    monkeypatch.setenv(ENV, str(path))
    assert client_config("b:1")["sasl.username"] == "old"
    path.write_text("sasl.username=new\n")
    assert client_config("b:1")["sasl.username"] == "new"


def test_an_unknown_property_names_the_line_and_the_key(tmp_path: Path) -> None:
    path = properties(
        tmp_path, f"security.protocol=SASL_SSL\nsasl.password={SECRET}\nsasl.mechansim=PLAIN\n"
    )
    assert refusal(path) == (f"{ENV} {path}: line 3: no such librdkafka property 'sasl.mechansim'")


def test_a_refused_value_names_the_key_not_the_value(tmp_path: Path) -> None:
    path = properties(tmp_path, f"security.protocol={SECRET}\n")
    assert (
        refusal(path)
        == f"{ENV} {path}: line 1: librdkafka refuses the value of 'security.protocol'"
    )


def test_a_malformed_line_a_python_callback_and_a_missing_file(tmp_path: Path) -> None:
    assert refusal(properties(tmp_path, f"# ok\n{SECRET}\n")).endswith(
        ": line 2: expected key=value"
    )
    assert "line 1: no such librdkafka property 'error_cb'" in refusal(
        properties(tmp_path, "error_cb=print\n")
    )
    assert "cannot be read (No such file or directory)" in refusal(tmp_path / "missing")


def test_an_unreadable_certificate_file_is_named(tmp_path: Path) -> None:
    """librdkafka loads the CA when the client is made: a wrong path fails before any run."""
    path = properties(tmp_path, "security.protocol=SSL\nssl.ca.location=/nowhere/ca.pem\n")
    assert refusal(path).startswith(f"{ENV} {path}: line 2: 'ssl.ca.location'")


def test_every_pin_command_fails_fast_on_a_bad_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pin outbox relay --once` with a misspelt key: one line, before PostgreSQL (here
    unreachable: a port nobody listens on) or Kafka is touched."""
    monkeypatch.setenv(
        ENV, str(properties(tmp_path, f"sasl.password={SECRET}\nsasl.mechansim=PLAIN\n"))
    )
    monkeypatch.setenv("PIN_PG_DSN", "postgresql://nobody@127.0.0.1:1/none")
    assert main(["outbox", "relay", "--once"]) == 1
    err = capsys.readouterr().err.strip()
    where = f"{ENV} {tmp_path / 'client.properties'}: line 2"
    assert err == f"pin: error: {where}: no such librdkafka property 'sasl.mechansim'"


@pytest.mark.parametrize(
    ("line", "cause"),
    [
        (
            "sasl_ssl://h:9093/bootstrap: SASL authentication error: Authentication failed during"
            " authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512",
            "authentication failed",
        ),
        (
            "ssl://h:9093/bootstrap: SSL handshake failed: error:0A000086:SSL routines::"
            "certificate verify failed: broker certificate could not be verified",
            "certificate not trusted",
        ),
        (
            "FAIL [rdkafka#producer-1] [thrd:h:9093/bootstrap]: h:9093/bootstrap: Disconnected:"
            " connection closed by peer: receive 0 after POLLIN (after 0ms in state"
            " APIVERSION_QUERY)",
            "the server requires TLS",
        ),
        (
            "sasl_ssl://h:9093/bootstrap: SASL PLAIN mechanism handshake failed: Broker:"
            " Unsupported SASL mechanism: broker's supported mechanisms: SCRAM-SHA-512,"
            "SCRAM-SHA-256",
            "the broker does not offer SASL mechanism PLAIN (it offers SCRAM-SHA-512,"
            "SCRAM-SHA-256)",
        ),
        ("h:9093/bootstrap: Connect to ipv4#127.0.0.1:9093 failed: Connection refused", None),
        (
            "FAIL [rdkafka#producer-1] [thrd:ssl://h:9093/bootstrap]: ssl://h:9093/bootstrap:"
            " Disconnected (after 0ms in state APIVERSION_QUERY)",
            None,
        ),
    ],
)
def test_librdkafka_lines_in_operator_words(line: str, cause: str | None) -> None:
    """The lines librdkafka 2.x gives for each refusal (as seen against the secured test
    broker); a refused connection is the network's, and a TLS client's disconnect is not
    "the server requires TLS"."""
    found = operator_cause(line)
    if cause is None:
        assert found is None
    else:
        assert found is not None and found.startswith(cause), found


def test_one_plaintext_disconnect_is_not_yet_a_tls_port() -> None:
    """A broker shutting down may close one plaintext connection at its first request, as a TLS
    port closes every one: the cause counts from its third sighting."""
    causes = Causes()
    line = "h:9093/bootstrap: Disconnected (after 0ms in state APIVERSION_QUERY)"
    causes.record("h:9093", line)
    causes.record("h:9093", line)
    assert causes.first("h:9093") is None
    causes.record("h:9093", line)
    assert causes.first("h:9093") == REQUIRES_TLS
    causes.forget("h:9093")
    causes.record("h:9093", line)
    assert causes.first("h:9093") is None
