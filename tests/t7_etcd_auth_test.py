"""Tier-9 tests: the coordination engine's traffic authenticated (issue 14).

A real etcd (Debian's 3.4) that serves its clients over TLS only and asks each for a
certificate its CA signed (``--client-cert-auth``: the certificate's CN is the etcd user),
with etcd's auth turned on by ``etcdctl`` as docs/security-etcd.md shows: a root user, and
for each job a user named as its certificate's CN with a role of readwrite on exactly
``/mtcfs/<job>/``, the daemons' default ``coord_prefix``. What a user checks:

* a 2-node job mounts with ``coord_ca``/``coord_cert``/``coord_key``, saves, every rank
  reads the checkpoint, and the job's keys are in etcd under its prefix and nowhere else;
* one job's certificate can neither read nor change another job's keys (PERMISSION_DENIED
  at once, never retried; the other job's keys unchanged);
* a client without a certificate, with one of another CA, with an expired one, in
  plaintext, or not trusting etcd's certificate is refused within its deadline, with the
  reason, and changes nothing;
* a daemon whose etcd user has no role for its prefix does not mount: one line naming the
  prefix, exit 1, in seconds, nothing left mounted;
* renewed certificate files are used without a restart.
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mtcfs.options import OptionError, parse_mount_options
from mtcfs.tiers.coord.membership import Membership, RankTaken
from mtcfs.tiers.coord.etcd import (
    Etcd, EtcdPermissionDenied, EtcdTls, EtcdUnavailable, absent, prefix_end, put_op,
)
from support.cluster import free_ports
from support.etcd import EtcdCluster, EtcdServerTls
from support.mount import MTCFS, is_mounted
from support.pki import TestCa
from support.poll import wait_for as _wait

JOBS = ("jobA", "jobB", "jobD")


def _prefix(job: str) -> bytes:
    return f"/mtcfs/{job}/".encode()


@pytest.fixture(scope="module")
def secure_etcd():
    """One etcd member: TLS only, client certificates required, auth on; users jobA,
    jobB, jobD with readwrite on their own ``/mtcfs/<job>/``, jobC with a role on another
    prefix only. Yields the cluster, its CA and each job's certificate."""
    root = Path(tempfile.mkdtemp(prefix="mtcfs-etcd-auth-", dir="/dev/shm"))
    ca = TestCa(root / "pki", "etcd")
    server = ca.issue("server", cn="etcd", ips=("127.0.0.1",))
    cluster = EtcdCluster(root / "etcd", 1,
                          tls=EtcdServerTls(server=server, admin=ca.issue("root", cn="root")))
    try:
        cluster.start()
        cluster.enable_auth({job: _prefix(job).decode() for job in JOBS})
        cluster.add_job_user("jobC", "/mtcfs/somewhere-else/")
        certs = {job: ca.issue(job, cn=job) for job in (*JOBS, "jobC")}
        yield SimpleNamespace(cluster=cluster, ca=ca, certs=certs, root=root)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _tls(e, job: str) -> EtcdTls:
    c = e.certs[job]
    return EtcdTls(str(c.ca), str(c.cert), str(c.key))


def _coord_options(e, job: str) -> dict[str, str]:
    c = e.certs[job]
    return {"coord": e.cluster.url, "coord_ca": str(c.ca), "coord_cert": str(c.cert),
            "coord_key": str(c.key)}


def _admin(e) -> Etcd:
    return Etcd(e.cluster.endpoints, timeout_s=5.0, tls=e.cluster.admin_tls())


def _keys(e, prefix: bytes) -> dict[bytes, tuple[bytes, int]]:
    """key -> (value, mod revision) of every key under ``prefix``, read as root."""
    c = _admin(e)
    try:
        kvs, _rev, _more, _n = c.range(prefix, prefix_end(prefix))
        return {kv.key: (kv.value, kv.mod_revision) for kv in kvs}
    finally:
        c.close()


# ---------------------------------------------------------------------- a job over TLS

def test_a_job_mounts_over_tls_and_its_keys_are_under_its_prefix(make_cluster, secure_etcd):
    """2 nodes of job A, scope=job (membership, step records and the namespace log all go
    through etcd), with job A's certificate: they mount, rank 0 saves, rank 1 reads the
    same bytes, both are registered, and every key of theirs is under /mtcfs/jobA/."""
    e = secure_etcd
    c = make_cluster(2, job="jobA", own_prefix=False,
                     options={"scope": "job", "replicas": 1, **_coord_options(e, "jobA")})
    data = os.urandom(300_000)
    c[0].path("step_10").mkdir()
    c[0].path("step_10", "__0_0.distcp").write_bytes(data)
    c[0].path("step_10", ".metadata").write_bytes(b"meta")
    assert c[1].path("step_10", "__0_0.distcp").read_bytes() == data
    for r in range(2):
        ms = c.status(r)["peers"]["membership"]
        assert ms["registered"], (r, ms)
    keys = _keys(e, b"/")
    mine = {k for k in keys if k.startswith(b"/mtcfs/jobA/")}
    for want in (b"members/000000", b"members/000001", b"ns/base", b"ns/last"):
        assert b"/mtcfs/jobA/" + want in mine, sorted(mine)
    outside = [k for k in keys if not any(k.startswith(_prefix(j)) for j in JOBS)]
    assert outside == [], outside


# ---------------------------------------------------------------------- one job, another's keys

def test_one_jobs_certificate_cannot_read_or_change_another_jobs_keys(secure_etcd):
    """Job A's certificate against job B's keys: every read, write, transaction, delete and
    watch is refused with PERMISSION_DENIED at once (no retry until a deadline), the error
    names B's keys, and B's keys are unchanged; A's own keys work."""
    e = secure_etcd
    b = Etcd(e.cluster.endpoints, timeout_s=5.0, tls=_tls(e, "jobB"))
    a = Etcd(e.cluster.endpoints, timeout_s=5.0, tls=_tls(e, "jobA"))
    pb_ = _prefix("jobB")
    try:
        b.put(pb_ + b"members/000000", b'{"rank":0,"address":"10.0.0.2:7470"}')
        b.put(pb_ + b"ns/last", b"op-1")
        before = _keys(e, pb_)
        assert len(before) >= 2
        attempts = {
            "get": lambda: a.get(pb_ + b"ns/last"),
            "range": lambda: a.range(pb_, prefix_end(pb_)),
            "range over every job": lambda: a.range(b"/", b"0"),
            "put": lambda: a.put(pb_ + b"members/000000", b'{"rank":0,"address":"evil:1"}'),
            "delete": lambda: a.delete(pb_, prefix_end(pb_)),
            "txn": lambda: a.txn([absent(pb_ + b"ns/op/x")],
                                 [put_op(pb_ + b"ns/op/x", b"{}"),
                                  put_op(pb_ + b"ns/last", b"ns/op/x")], retry=True),
            "watch": lambda: next(iter(a.watch(pb_, prefix_end(pb_), 1))),
        }
        for what, attempt in attempts.items():
            t0 = time.monotonic()
            with pytest.raises(EtcdPermissionDenied) as got:
                attempt()
            assert time.monotonic() - t0 < 2.0, what  # not retried until the deadline
            msg = str(got.value)
            assert "permission denied" in msg and str(e.certs["jobA"].cert) in msg, msg
            if what != "range over every job":
                assert "/mtcfs/jobB/" in msg, msg
        assert _keys(e, pb_) == before
        # and job A's own keys are its to use
        a.put(_prefix("jobA") + b"probe", b"1")
        assert a.get(_prefix("jobA") + b"probe")[0].value == b"1"
    finally:
        a.close()
        b.close()


def test_another_jobs_keepalive_does_not_keep_a_dead_rank_from_its_replacement(secure_etcd):
    """etcd 3.4's roles do not confine leases: job A's certificate can renew a lease of job
    B's (the limit docs/security-etcd.md states). A rank of B whose daemon died (no
    revoke) while A renews its lease no longer blocks B's replacement for that rank: the
    replacement takes the record over after its wait, the dead holder cannot write it
    back, and the lease A renewed is revoked. A LIVE holder still keeps its rank: a second
    daemon for it is refused (RankTaken, one line) and the holder's record is back."""
    e = secure_etcd
    pb_ = _prefix("jobB").decode()
    b1, b2, b3 = (Etcd(e.cluster.endpoints, timeout_s=5.0, tls=_tls(e, "jobB"))
                  for _ in range(3))
    a = Etcd(e.cluster.endpoints, timeout_s=5.0, tls=_tls(e, "jobA"))
    stop = threading.Event()
    renewed: list[int] = []
    dead = Membership(b1, pb_, 21, "10.0.0.1:7470", ttl_s=2)
    replacement = Membership(b2, pb_, 21, "10.0.0.9:7470", ttl_s=2)
    try:
        dead.join()
        dead.stop()  # as kill -9: renewals stop, the lease is not revoked
        assert a.keepalive(dead.lease) > 0  # the other job CAN renew it (etcd 3.4)

        def renew() -> None:
            while not stop.wait(0.3):
                renewed.append(a.keepalive(dead.lease))
        t = threading.Thread(target=renew, daemon=True)
        t.start()
        t0 = time.monotonic()
        replacement.join(wait_s=3)  # before: RankTaken for as long as A renews
        assert time.monotonic() - t0 < 3 + 3 + 2
        assert replacement.view()[21].address == "10.0.0.9:7470"
        _wait(lambda: renewed and renewed[-1] <= 0, 5, "the dead holder's lease revoked")
        time.sleep(1.0)  # (a dead holder never writes back: nothing to wait for)
        assert replacement.view()[21].address == "10.0.0.9:7470" and not replacement.error
        # a live holder is not taken over
        second = Membership(b3, pb_, 21, "10.0.0.8:7470", ttl_s=2, watch=False)
        with pytest.raises(RankTaken) as got:
            second.join(wait_s=1)
        assert "\n" not in str(got.value) and "10.0.0.9:7470" in str(got.value)
        _wait(lambda: replacement.view()[21].address == "10.0.0.9:7470", 5,
              "the live holder's record back")
        assert not replacement.error
        # a record of a daemon from before the takeover (no "defends": it cannot answer)
        # keeps the old rule: refused after the wait, the record left as it was
        old_lease, _ttl = b3.grant(2)
        old = b'{"rank":22,"address":"10.0.0.7:7470","boot":"0123456789abcdef"}'
        b3.put(_prefix("jobB") + b"members/000022", old, lease=old_lease)
        renewed_old = threading.Thread(
            target=lambda: [a.keepalive(old_lease) for _ in iter(lambda: stop.wait(0.3), True)],
            daemon=True)
        renewed_old.start()
        third = Membership(b3, pb_, 22, "10.0.0.6:7470", ttl_s=2, watch=False)
        with pytest.raises(RankTaken):
            third.join(wait_s=1)
        assert b3.get(_prefix("jobB") + b"members/000022")[0].value == old
    finally:
        stop.set()
        replacement.leave()
        dead.leave()
        for c in (a, b1, b2, b3):
            c.close()


# ---------------------------------------------------------------------- outsiders

def test_outsiders_are_refused_with_the_reason_and_change_nothing(secure_etcd):
    """No certificate, a certificate of another CA, an expired one of the right CA,
    plaintext, and a client that does not trust etcd's certificate: each write fails
    within its deadline (2 s here) with EtcdUnavailable and the TLS reason; nothing is
    written."""
    e = secure_etcd
    stranger = TestCa(e.root / "pki-stranger", "stranger")
    foreign = stranger.issue("jobA-foreign", cn="jobA")  # right name, wrong CA
    expired = e.ca.issue("jobA-expired", cn="jobA",
                         valid_from=dt.datetime.now(dt.UTC) - dt.timedelta(days=2),
                         valid_for=dt.timedelta(days=1))
    ca = str(e.ca.ca)
    cases = {
        "no client certificate": (EtcdTls(ca), "TLS with etcd failed"),
        "another CA's certificate": (EtcdTls(ca, str(foreign.cert), str(foreign.key)),
                                     "TLS with etcd failed"),
        "an expired certificate": (EtcdTls(ca, str(expired.cert), str(expired.key)),
                                   "TLS with etcd failed"),
        "etcd's certificate not trusted": (
            EtcdTls(str(stranger.ca), str(e.certs["jobA"].cert), str(e.certs["jobA"].key)),
            "CERTIFICATE_VERIFY_FAILED"),
        "plaintext": (None, "Socket closed"),
    }
    key = _prefix("jobA") + b"outsider"
    for what, (tls, reason) in cases.items():
        c = Etcd(e.cluster.endpoints, timeout_s=2.0, tls=tls)
        t0 = time.monotonic()
        try:
            with pytest.raises(EtcdUnavailable) as got:
                c.put(key, b"x")
        finally:
            c.close()
        assert time.monotonic() - t0 < 5.0, what
        assert reason in str(got.value), (what, str(got.value))
    assert _keys(e, key) == {}


# ---------------------------------------------------------------------- a daemon without a role

def test_a_daemon_whose_user_has_no_role_for_its_prefix_does_not_mount(shm_dir, secure_etcd):
    """jobC's etcd user has a role on another prefix only: its daemon's mount fails in
    seconds (not at mount_timeout, not retrying for ever) with one line naming its prefix
    /mtcfs/jobC/ and the refusal, its log says the same, and nothing stays mounted."""
    e = secure_etcd
    mnt, store = shm_dir / "mnt", shm_dir / "store"
    mnt.mkdir()
    port = free_ports(1)[0]
    peer = TestCa(shm_dir / "peer-ca", "jobC").issue_rank("jobC", 0)
    opts = {"store": str(store), "size": "256M", "rank": "0", "nodes": "2",
            "listen": f"127.0.0.1:{port}", **_coord_options(e, "jobC"),
            "tls_ca": str(peer.ca), "tls_cert": str(peer.cert), "tls_key": str(peer.key)}
    t0 = time.monotonic()
    r = subprocess.run([*MTCFS, "jobC", str(mnt), "-o",
                        ",".join(f"{k}={v}" for k, v in opts.items())],
                       capture_output=True, text=True, timeout=120, check=False)
    took = time.monotonic() - t0
    try:
        assert r.returncode == 1, (r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert "/mtcfs/jobC/" in lines[0] and "permission denied" in lines[0], lines[0]
        assert took < 30, took
        log = (store / "mtcfs.log").read_text()
        assert "etcd denies rank 0 the job's keys under /mtcfs/jobC/" in log, log[-3000:]
        assert not is_mounted(str(mnt))
        assert _keys(e, _prefix("jobC")) == {}
    finally:
        if is_mounted(str(mnt)):
            subprocess.run([*MTCFS, "umount", str(mnt), "--force"], capture_output=True,
                           check=False)


# ---------------------------------------------------------------------- revoked while mounted

def test_a_role_revoked_while_mounted_fails_calls_at_once_and_says_why(make_cluster,
                                                                      secure_etcd):
    """Job D mounted; the admin revokes its role's permission: a create fails with EIO at
    once (not after coord_timeout), the daemon's log names the refused key under
    /mtcfs/jobD/; granted again, creates work again without a remount."""
    e = secure_etcd
    c = make_cluster(2, job="jobD", own_prefix=False,
                     options={"scope": "job", "replicas": 1, "coord_timeout": "30s",
                              **_coord_options(e, "jobD")})
    c[0].path("before").write_bytes(b"1")
    e.cluster.etcdctl("role", "revoke-permission", "jobD", "--prefix=true", "/mtcfs/jobD/")
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError) as got:
            c[0].path("during").write_bytes(b"2")
        assert got.value.errno == errno.EIO
        assert time.monotonic() - t0 < 10, "retried a refusal instead of failing at once"
        log = c[0].log()
        assert "denied" in log and "/mtcfs/jobD/" in log and "permission denied" in log, \
            log[-3000:]
    finally:
        e.cluster.etcdctl("role", "grant-permission", "jobD", "--prefix=true", "readwrite",
                          "/mtcfs/jobD/")

    def created() -> bool:
        try:
            c[0].path("after").write_bytes(b"3")
            return True
        except OSError:
            return False
    _wait(created, 30, "a create once the role is granted again")
    assert c[1].path("after").read_bytes() == b"3"


# ---------------------------------------------------------------------- rotation

def test_renewed_certificate_files_are_used_without_a_restart(secure_etcd, tmp_path):
    """A client whose certificate expired is refused; the files are replaced on disk by a
    renewed certificate (an atomic rename, as a Kubernetes Secret or a cert-manager
    renewal does): the same client's calls succeed within a few seconds."""
    e = secure_etcd
    ca = e.ca
    old = ca.issue("rot-old", cn="jobA",
                   valid_from=dt.datetime.now(dt.UTC) - dt.timedelta(days=2),
                   valid_for=dt.timedelta(days=1))
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    shutil.copyfile(old.cert, cert)
    shutil.copyfile(old.key, key)
    c = Etcd(e.cluster.endpoints, timeout_s=2.0, tls=EtcdTls(str(ca.ca), str(cert), str(key)))
    try:
        with pytest.raises(EtcdUnavailable):
            c.put(_prefix("jobA") + b"rotated", b"x")
        new = ca.issue("rot-new", cn="jobA")
        for src, dst in ((new.key, key), (new.cert, cert)):
            shutil.copyfile(src, str(dst) + ".tmp")
            os.replace(str(dst) + ".tmp", dst)

        def works() -> bool:
            try:
                c.put(_prefix("jobA") + b"rotated", b"renewed")
                return True
            except EtcdUnavailable:
                return False
        _wait(works, 15, "the renewed certificate to be used")
        assert c.tls_reloads >= 1
        assert _keys(e, _prefix("jobA") + b"rotated")[_prefix("jobA") + b"rotated"][0] \
            == b"renewed"
    finally:
        c.close()


# ---------------------------------------------------------------------- options

def _parse(tmp_path, **kw):
    # (the peers in plaintext: only etcd's options are under test here)
    base = {"rank": "0", "nodes": "2", "coord": "etcd://127.0.0.1:2379", "listen": "h:1",
            "insecure": None}
    opts = ",".join(k if v is None else f"{k}={v}" for k, v in {**base, **kw}.items())
    return parse_mount_options("j", str(tmp_path), [opts])


@pytest.fixture
def pem(tmp_path):
    ca = TestCa(tmp_path / "pki", "opt")
    return ca.issue("client", cn="jobX")


def test_coord_tls_options_are_read_and_checked(tmp_path, pem):
    o = _parse(tmp_path, coord_ca=pem.ca, coord_cert=pem.cert, coord_key=pem.key)
    assert (o.coord_ca, o.coord_cert, o.coord_key) == (str(pem.ca), str(pem.cert),
                                                        str(pem.key))
    o = _parse(tmp_path, coord_ca=pem.ca)  # server-only TLS
    assert o.coord_cert is None and o.coord_key is None
    assert _parse(tmp_path).coord_ca is None  # plaintext stays the default


@pytest.mark.parametrize("kw, words", [
    ({"coord_ca": "/nonexistent/ca.pem"}, ["coord_ca=/nonexistent/ca.pem", "cannot read",
                                           "No such file"]),
    ({"coord_ca": "CA", "coord_cert": "CERT"}, ["coord_cert=", "needs coord_key="]),
    ({"coord_ca": "CA", "coord_key": "KEY"}, ["coord_key=", "needs coord_cert="]),
    ({"coord_cert": "CERT", "coord_key": "KEY"}, ["coord_cert=", "needs coord_ca="]),
    ({"coord_ca": "KEY"}, ["coord_ca=", "holds no PEM CERTIFICATE"]),
    ({"coord_ca": "CA", "coord_cert": "CERT", "coord_key": "CERT"},
     ["coord_key=", "holds no PEM PRIVATE KEY"]),
    ({"coord_ca": "EMPTY"}, ["coord_ca=", "is empty"]),
])
def test_bad_coord_tls_options_are_one_line_naming_option_and_file(tmp_path, pem, kw, words):
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    files = {"CA": pem.ca, "CERT": pem.cert, "KEY": pem.key, "EMPTY": empty}
    kw = {k: files.get(v, v) for k, v in kw.items()}
    with pytest.raises(OptionError) as got:
        _parse(tmp_path, **kw)
    msg = str(got.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_coord_tls_options_need_coord(tmp_path, pem):
    with pytest.raises(OptionError, match="coord_ca=.*needs coord=etcd://"):
        parse_mount_options("j", str(tmp_path), [f"coord_ca={pem.ca}"])


def test_cli_refuses_an_unreadable_coord_file_with_exit_2(shm_dir, pem):
    """The mount command: exit 2, one line naming the option and the file, nothing
    mounted, no store created."""
    mnt = shm_dir / "mnt"
    mnt.mkdir()
    opts = (f"store={shm_dir}/s,rank=0,nodes=2,coord=etcd://127.0.0.1:1,"
            f"coord_ca={pem.ca},coord_cert={pem.cert},coord_key=/no/such.key")
    r = subprocess.run([*MTCFS, "job", str(mnt), "-o", opts], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "coord_key=/no/such.key" in lines[0] \
        and "/no/such.key" in lines[0], r.stderr
    assert not is_mounted(str(mnt)) and not (shm_dir / "s").exists()


def test_status_says_etcd_refuses_rather_than_does_not_answer():
    """``mtcfs status``'s namespace line tells a refusal from an etcd that is unreachable."""
    from mtcfs.cli import format_namespace_status
    ns = {"engine": "etcd", "endpoints": ["10.0.0.11:2379"], "seq": 7, "unavailable_s": 3.0,
          "last_error": "etcd 10.0.0.11:2379 denied Range of key '/mtcfs/j/ns/last': "
                        "PERMISSION_DENIED", "denied": True}
    line = format_namespace_status(ns)
    assert "etcd REFUSES this node's keys" in line and "/mtcfs/j/ns/last" in line, line
    line = format_namespace_status({**ns, "denied": False, "last_error": "DEADLINE_EXCEEDED"})
    assert "etcd does not answer (DEADLINE_EXCEEDED)" in line, line
