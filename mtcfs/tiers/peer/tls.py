"""Mutual TLS between the peers of one job: who a caller is, and the credentials that prove
who this node is (docs/security.md).

Identity. A job has its own certificate authority (the *job CA*). It signs one certificate
per rank, which carries two subject alternative names:

* ``URI:mtcfs://<job>/rank/<rank>``: who the holder is. A server reads it from the caller's
  verified certificate (gRPC's ``peer_uri`` auth property) and serves a call only when it
  names this job and the rank the request says it comes from.
* ``DNS:<job>.mtcfs``: what a client checks of a server (the channel's target name is
  overridden to it), so a node of another job signed by the same CA is refused by the
  handshake, whatever address it answers on.

The idea of naming a workload by a URI SAN in an X.509 certificate is SPIFFE's X.509-SVID
(https://github.com/spiffe/spiffe/blob/main/standards/X509-SVID.md); mtcfs uses its own
scheme so a deployment needs no SPIFFE infrastructure.

Rotation. :class:`TlsFiles` re-reads the three PEM files when one of them changes on disk
(checked at most every :data:`RELOAD_CHECK_S` seconds). The server's credentials are dynamic
(every new handshake uses the newest files); clients build new channels when the files have
changed (mtcfs/tiers/peer/tier.py). Connections already open keep their session: TLS checks a
certificate at the handshake only.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

# The identities certificates carry are named in the shared bottom (the CA issues them);
# re-exported: this module is where the peer tier's callers look for them.
from mtcfs.base.pki import identity_uri as identity_uri
from mtcfs.base.pki import parse_identity as parse_identity
from mtcfs.base.pki import server_name as server_name

log = logging.getLogger(__name__)

#: Seconds between checks of the files' modification times.
RELOAD_CHECK_S = 5.0


class TlsError(ValueError):
    """The TLS files are missing, unreadable, inconsistent or not this rank's; the message is
    one line that names the file and what to fix."""


def caller_identities(context: grpc.ServicerContext) -> list[tuple[str, int]]:
    """The ``(job, rank)`` identities of a call's verified client certificate (empty when the
    call came without TLS or the certificate names none)."""
    found = []
    for raw in context.auth_context().get("peer_uri", []):
        ident = parse_identity(raw.decode("utf-8", "replace"))
        if ident is not None:
            found.append(ident)
    return found


@dataclass(frozen=True)
class _Loaded:
    ca: bytes
    cert: bytes
    key: bytes
    stamp: tuple[tuple[int, int], ...]
    generation: int


class TlsFiles:
    """The job CA, this rank's certificate and its key, as PEM files on disk.

    Args:
        ca: path of the job CA's certificate (PEM; a bundle of several is allowed, e.g. the
            old and the new CA during a CA rotation).
        cert: path of this rank's certificate (PEM).
        key: path of its private key (PEM, unencrypted; mode 0600 is the caller's business).

    Raises:
        TlsError: when a file cannot be read.

    Thread-safe; :meth:`current` is cheap (a clock read) between checks.
    """

    def __init__(self, ca: str, cert: str, key: str) -> None:
        self.paths = {"tls_ca": ca, "tls_cert": cert, "tls_key": key}
        self._lock = threading.Lock()
        self._next_check = 0.0
        self._loaded = self._load(generation=0)

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        out = []
        for name, path in self.paths.items():
            try:
                st = os.stat(path)
            except OSError as exc:
                raise TlsError(f"{name}={path}: {exc.strerror}") from None
            out.append((st.st_mtime_ns, st.st_size))
        return tuple(out)

    def _load(self, generation: int) -> _Loaded:
        stamp = self._stamp()
        data = {}
        for name, path in self.paths.items():
            try:
                with open(path, "rb") as f:
                    data[name] = f.read()
            except OSError as exc:
                raise TlsError(f"{name}={path}: {exc.strerror}") from None
        return _Loaded(data["tls_ca"], data["tls_cert"], data["tls_key"], stamp, generation)

    def current(self) -> _Loaded:
        """The files' contents, re-read when one changed on disk (at most every
        :data:`RELOAD_CHECK_S`). A file that cannot be read or parsed now keeps the last
        good contents (logged), so a rotation half done is not a failure."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_check:
                return self._loaded
            self._next_check = now + RELOAD_CHECK_S
            try:
                if self._stamp() == self._loaded.stamp:
                    return self._loaded
                fresh = self._load(self._loaded.generation + 1)
                check_pair(fresh.cert, fresh.key, self.paths["tls_cert"])
            except TlsError as exc:
                log.warning("TLS files changed but cannot be used yet, keeping the old ones: "
                            "%s", exc)
                return self._loaded
            log.info("TLS files changed on disk: using them for new connections (generation "
                     "%d)", fresh.generation)
            self._loaded = fresh
            return fresh

    @property
    def generation(self) -> int:
        """Counts reloads; a client rebuilds its channel when this changes."""
        return self.current().generation

    # -- credentials ----------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that require and verify a client certificate signed by the job CA,
        re-reading the files for each new handshake when they changed."""
        def fetch() -> grpc.ServerCertificateConfiguration:
            cur = self.current()
            if cur.generation == served[0]:
                return None  # grpc: keep the current one
            served[0] = cur.generation
            return grpc.ssl_server_certificate_configuration([(cur.key, cur.cert)], cur.ca)

        first = self.current()
        served = [first.generation]
        return grpc.dynamic_ssl_server_credentials(
            grpc.ssl_server_certificate_configuration([(first.key, first.cert)], first.ca),
            fetch, require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a client: this rank's certificate, the job CA as the only root."""
        cur = self.current()
        return grpc.ssl_channel_credentials(cur.ca, cur.key, cur.cert)

    # -- start-up check -------------------------------------------------------------------

    def check_for(self, job: str, rank: int, *, now: dt.datetime | None = None) -> None:
        """Check, at start, that the files make a working identity for ``rank`` of ``job``:
        the key matches the certificate, the job CA signed it, it is valid now, and it names
        :func:`identity_uri` and :func:`server_name`.

        Raises:
            TlsError: one line naming the option and what is wrong.
        """
        cur = self.current()
        cert = check_pair(cur.cert, cur.key, self.paths["tls_cert"])
        where = f"tls_cert={self.paths['tls_cert']}"
        try:
            cas = x509.load_pem_x509_certificates(cur.ca)
        except ValueError:
            raise TlsError(f"tls_ca={self.paths['tls_ca']}: no PEM certificate in it") from None
        if not any(_signed_by(cert, ca) for ca in cas):
            raise TlsError(f"{where} is not signed by the CA in "
                           f"tls_ca={self.paths['tls_ca']}")
        now = now or dt.datetime.now(dt.timezone.utc)
        if now < cert.not_valid_before_utc or now > cert.not_valid_after_utc:
            raise TlsError(f"{where} is valid {cert.not_valid_before_utc:%Y-%m-%d %H:%M} .. "
                           f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now")
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            san = x509.SubjectAlternativeName([])
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
        want = identity_uri(job, rank)
        if want not in uris:
            raise TlsError(f"{where} names {', '.join(uris) or 'no mtcfs identity'}; rank "
                           f"{rank} of this job needs the subject alternative name URI:{want}")
        dns = san.get_values_for_type(x509.DNSName)
        if server_name(job) not in dns:
            raise TlsError(f"{where} lacks the subject alternative name "
                           f"DNS:{server_name(job)} that peers check")


def check_pair(cert_pem: bytes, key_pem: bytes, where: str) -> x509.Certificate:
    """The certificate in ``cert_pem`` after checking that ``key_pem`` is its private key.

    Raises:
        TlsError: not PEM, or the key belongs to another certificate.
    """
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise TlsError(f"tls_cert={where}: no PEM certificate in it") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"tls_key for {where}: not an unencrypted PEM private key ({exc})") \
            from None
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if (key.public_key().public_bytes(serialization.Encoding.DER, pub)
            != cert.public_key().public_bytes(serialization.Encoding.DER, pub)):
        raise TlsError(f"tls_key is not the private key of tls_cert={where}")
    return cert


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
