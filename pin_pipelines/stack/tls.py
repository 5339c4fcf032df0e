"""A local certificate authority for a secured estate on loopback (`pin stack up --secure`, the
tests of section 8): a CA, server certificates for `localhost`/`127.0.0.1`, client certificates
for mutual TLS, and the PKCS12 keystores a JVM (Kafka) reads.

Made with the `openssl` command rather than the `cryptography` package: the files are what an
operator would make by hand, and every server here (PostgreSQL, Kafka, ClickHouse) reads PEM or
PKCS12 as `openssl` writes them.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from pin_pipelines.errors import PinError, first_line

#: Names every loopback server certificate answers to, so `verify-full` and hostname checks hold.
LOOPBACK_NAMES = ("DNS:localhost", "IP:127.0.0.1")
DAYS = 3650


@dataclass(frozen=True)
class Issued:
    """A certificate and its unencrypted private key (PEM), readable by their owner only."""

    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    try:
        subprocess.run(["openssl", *args], check=True, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise PinError("openssl is not installed: apt-get install openssl") from exc
    except subprocess.CalledProcessError as exc:
        raise PinError(f"openssl {args[0]} failed: {first_line(Exception(exc.stderr))}") from exc


@dataclass(frozen=True)
class LocalCA:
    """A CA under `folder` (`ca.crt`, `ca.key`); made once, reused while its files exist."""

    folder: Path
    name: str = "pin local CA"

    @property
    def cert(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def key(self) -> Path:
        return self.folder / "ca.key"

    def ensure(self) -> LocalCA:
        if not (self.cert.exists() and self.key.exists()):
            self.folder.mkdir(parents=True, exist_ok=True)
            _openssl(
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", str(DAYS),
                "-subj", f"/CN={self.name}", "-keyout", str(self.key), "-out", str(self.cert),
            )  # fmt: skip
            self.key.chmod(0o600)
        return self

    def issue(self, name: str, *, client: bool = False) -> Issued:
        """A certificate for `name` signed by this CA: a server's for the loopback names, or a
        client's (`client=True`) whose common name is `name` (the user mutual TLS maps it to).
        Reissued only when its files are missing."""
        self.ensure()
        issued = Issued(self.folder / f"{name}.crt", self.folder / f"{name}.key")
        if issued.cert.exists() and issued.key.exists():
            return issued
        request = self.folder / f"{name}.csr"
        extensions = self.folder / f"{name}.ext"
        usage = "clientAuth" if client else "serverAuth"
        san = "" if client else f"subjectAltName={','.join(LOOPBACK_NAMES)}\n"
        extensions.write_text(f"{san}extendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
        _openssl(
            "req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(issued.key), "-out", str(request),
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(request), "-CA", str(self.cert), "-CAkey", str(self.key),
            "-CAcreateserial", "-days", str(DAYS), "-extfile", str(extensions),
            "-out", str(issued.cert),
        )  # fmt: skip
        issued.key.chmod(0o600)
        request.unlink()
        extensions.unlink()
        return issued

    def pkcs12(self, issued: Issued, password: str) -> Path:
        """`issued` with the CA's chain as a PKCS12 keystore (a JVM's `ssl.keystore.location`)."""
        store = issued.cert.with_suffix(".p12")
        if not store.exists():
            _openssl(
                "pkcs12", "-export", "-in", str(issued.cert), "-inkey", str(issued.key),
                "-certfile", str(self.cert), "-name", issued.cert.stem,
                "-passout", f"pass:{password}", "-out", str(store),
            )  # fmt: skip
            store.chmod(0o600)
        return store
