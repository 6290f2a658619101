"""A job's certificate authority: a CA and the certificates it signs, written as PEM files
the way a deployment mounts them (``mtcfs certs``; docs/security.md shows the same with
openssl). Used by ``mtcfs certs``, the demos and the tests.

Built on ``cryptography`` (ECDSA P-256 keys: a CA and a certificate in about 2 ms each). The
identity a peer certificate carries is defined in mtcfs/tiers/peer/tls.py.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


_URI_RE = re.compile(r"^mtcfs://([A-Za-z0-9][A-Za-z0-9._-]{0,127})/rank/(0|[1-9][0-9]{0,8})$")


def identity_uri(job: str, rank: int) -> str:
    """The URI SAN a rank's certificate carries, e.g. ``mtcfs://llama/rank/3``."""
    return f"mtcfs://{job}/rank/{rank}"


def server_name(job: str) -> str:
    """The DNS SAN every peer certificate of ``job`` carries; clients check it."""
    return f"{job}.mtcfs"


def parse_identity(uri: str) -> tuple[str, int] | None:
    """``(job, rank)`` of an identity URI, or None when ``uri`` is not one."""
    m = _URI_RE.match(uri)
    return (m.group(1), int(m.group(2))) if m else None


@dataclass(frozen=True)
class Issued:
    """PEM files of one certificate: ``cert``, ``key`` and the ``ca`` that signed it."""

    cert: Path
    key: Path
    ca: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


class JobCa:
    """A new certificate authority in ``directory``: ``<name>-ca.pem`` and ``<name>-ca.key``
    (mode 0600), valid for ``days`` days.

    Raises:
        OSError: the directory cannot be written.
    """

    def __init__(self, directory: Path, name: str = "job", days: int = 30) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"{name} CA")).issuer_name(_name(f"{name} CA"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256()))
        self.ca = self.dir / f"{name}-ca.pem"
        self.ca.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        _write_key(self.dir / f"{name}-ca.key", self._key)

    def issue(self, stem: str, *, cn: str | None = None, uris: tuple[str, ...] = (),
              dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
              valid_for: dt.timedelta = dt.timedelta(days=7),
              valid_from: dt.datetime | None = None) -> Issued:
        """Sign a certificate for both TLS server and client use with these subject
        alternative names; write ``<stem>.pem`` and ``<stem>.key`` (0600) and return them.
        ``valid_from``/``valid_for`` set its validity (default: from 5 minutes ago, 7 days)."""
        key = ec.generate_private_key(ec.SECP256R1())
        start = valid_from or dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
        sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        sans += [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        b = (x509.CertificateBuilder()
             .subject_name(_name(cn or stem)).issuer_name(self._cert.subject)
             .public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(start).not_valid_after(start + valid_for)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                   ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(self._key, hashes.SHA256())
        path = self.dir / f"{stem}.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(self.dir / f"{stem}.key", key)
        return Issued(cert=path, key=self.dir / f"{stem}.key", ca=self.ca)

    def issue_rank(self, job: str, rank: int, *,
                   valid_for: dt.timedelta = dt.timedelta(days=7),
                   valid_from: dt.datetime | None = None) -> Issued:
        """The peer certificate of ``rank`` of ``job`` (``rank-<rank>.pem``/``.key``): the
        URI and DNS names mtcfs/tiers/peer/tls.py checks."""
        return self.issue(f"rank-{rank}", cn=f"{job} rank {rank}",
                          uris=(identity_uri(job, rank),), dns=(server_name(job),),
                          valid_for=valid_for, valid_from=valid_from)
