"""Mount options: parsing and checking, no mount (the user-visible failure of a bad one is
in t2_options_test.py)."""

import pytest

from mtcfs.cli import format_peer_status
from mtcfs.options import (
    DEFAULT_PEER_PORT, OptionError, parse_address, parse_mount_options, parse_size,
)


def test_parse_full_option_set():
    o = parse_mount_options("myjob", "/mnt/ckpt", [
        "store=/dev/shm/x,size=60G,backup=gs://bucket/prefix,backup_interval=10m,keep=3",
        "chunk_size=8M,allow_other,debug,rw,nosuid,nodev,_netdev,x-systemd.automount"])
    assert o.store == "/dev/shm/x"
    assert o.size == 60 * 1024 ** 3
    assert o.backup == "gs://bucket/prefix"
    assert o.backup_interval.seconds == 600 and o.backup_interval.checkpoints is None
    assert o.keep == 3 and o.chunk_size == 8 * 1024 ** 2
    assert o.allow_other and o.debug


def test_read_timeout():
    assert parse_mount_options("j", "/m", []).read_timeout == 60
    assert parse_mount_options("j", "/m", ["read_timeout=2m"]).read_timeout == 120


def test_direct_writes():
    assert parse_mount_options("j", "/m", []).direct_writes is True
    assert parse_mount_options("j", "/m", ["direct_writes=no"]).direct_writes is False
    assert parse_mount_options("j", "/m", ["direct_writes=yes"]).direct_writes is True


def test_checkpoint_count_interval():
    o = parse_mount_options("j", "/m", ["backup=file:///b,backup_interval=5ckpt"])
    assert o.backup_interval.checkpoints == 5 and o.backup_interval.seconds is None


@pytest.mark.parametrize("text,bytes_", [("512K", 512 * 1024), ("1.5G", 3 * 1024 ** 3 // 2),
                                         ("60GiB", 60 * 1024 ** 3), ("4096", 4096)])
def test_sizes(text, bytes_):
    assert parse_size(text) == bytes_


@pytest.mark.parametrize("opt,word", [
    ("size=lots", "size=lots"), ("bogus=1", "bogus"), ("keep=0", "keep=0"),
    ("backup=s3://x", "backup=s3://x"), ("backup=file://relative", "backup=file://relative"),
    ("backup_interval=often", "backup_interval=often"), ("chunk_size=3M", "chunk_size=3M"),
    ("allow_other=1", "allow_other=1"), ("restore=yesterday", "restore=yesterday"),
    ("read_timeout=0.5", "read_timeout=0.5"), ("read_timeout=2h", "read_timeout=2h"),
    ("read_timeout=soon", "read_timeout=soon"), ("direct_writes=1", "direct_writes=1")])
def test_bad_option_names_the_option(opt, word):
    with pytest.raises(OptionError) as ei:
        parse_mount_options("j", "/m", [opt])
    assert word in str(ei.value)


# ---------------------------------------------------------------------- peer tier options

PEERS3 = "10.0.0.1:7470,10.0.0.2:7470,10.0.0.3:7470"


def parse(*opts: str):
    """Parse; a multi-node mount that names no TLS files is parsed as ``insecure``, and one
    with no address as ``listen=h:1`` (both have their own tests below)."""
    text = ",".join(opts)
    if "nodes=" in text and "insecure" not in text and not (
            "tls_" in text and "coord_ca" in text):
        opts = (*opts, "insecure")
    if "nodes=" in text and "listen=" not in text and "peers=" not in text:
        opts = (*opts, "listen=h:1")  # the default is this host's address (tested below)
    return parse_mount_options("j", "/m", list(opts))


def parse_exactly(*opts: str):
    return parse_mount_options("j", "/m", list(opts))


def test_single_node_defaults():
    o = parse("")
    assert (o.rank, o.nodes, o.replicas, o.placement) == (0, 1, 1, "ring")
    assert o.listen is None and o.peers is None and o.coord is None
    assert o.topology == {} and o.assume_data_parallelism is None and not o.huge_model
    assert not o.multi_node
    assert o.peer_address(0) is None


def test_three_nodes_with_peers():
    o = parse(f"rank=1,nodes=3,peers={PEERS3},replicas=1,coord=etcd://e:1")
    assert o.multi_node and o.rank == 1 and o.nodes == 3 and o.replicas == 1
    assert o.peers == ["10.0.0.1:7470", "10.0.0.2:7470", "10.0.0.3:7470"]
    assert o.listen == "10.0.0.2:7470"  # peers[rank]
    assert [o.peer_address(r) for r in range(3)] == o.peers
    with pytest.raises(ValueError):
        o.peer_address(3)


@pytest.mark.parametrize("sep", [";", "+"])
def test_peers_other_separators(sep):
    o = parse(f"nodes=3,peers={PEERS3.replace(',', sep)},rank=2,coord=etcd://e:1")
    assert o.peers == PEERS3.split(",") and o.listen == "10.0.0.3:7470"


def test_peers_continue_across_commas_and_mixed_separators():
    # the way fstab and mount.fuse3 hand them over: one comma-separated list of options
    o = parse("nodes=4,peers=a:1,b:2;c:3,d:4,debug,rank=3,coord=etcd://e:1")
    assert o.peers == ["a:1", "b:2", "c:3", "d:4"] and o.debug and o.rank == 3
    o = parse("peers=a:1", "b:2", "nodes=2,coord=etcd://e:1")  # several -o groups read as one list
    assert o.peers == ["a:1", "b:2"]


def test_explicit_listen_and_no_peers():
    o = parse("nodes=2,rank=1,coord=etcd://e:1,listen=0.0.0.0:0")
    assert o.listen == "0.0.0.0:0" and o.peers is None and o.coord == ["e:1"]
    assert o.peer_address(0) is None  # learned from etcd at run time
    o = parse("nodes=2,coord=etcd://e:1,listen=0.0.0.0:7470")  # a wildcard when asked
    assert o.listen == "0.0.0.0:7470"
    o = parse("nodes=2,peers=a:1,b:2,listen=[::]:7470,coord=etcd://e:1")
    assert o.listen == "[::]:7470"


@pytest.mark.parametrize("addr", ["host:7470", "10.0.0.1:0", "a.b-c_d:65535", "[::1]:7470",
                                  "[fe80::1%eth0]:1"])
def test_good_addresses(addr):
    assert parse_address(addr) == addr


@pytest.mark.parametrize("addr", ["host", "host:", ":7470", "host:65536", "host:-1", "host:x",
                                  "::1:7470", "[::1]", "[::1]7470", "[]:1", "a b:1", "a/b:1"])
def test_bad_addresses(addr):
    with pytest.raises(ValueError):
        parse_address(addr)


def test_topology_labels_continue_across_commas():
    o = parse("topology=zone=a,block=3,host=17,debug")
    assert o.topology == {"zone": "a", "block": "3", "host": "17"} and o.debug
    assert parse("topology=zone=a;block=3+host=17").topology == \
        {"zone": "a", "block": "3", "host": "17"}
    # a known option ends the list; a later topology= starts it afresh
    o = parse("topology=zone=a,keep=5,topology=zone=b")
    assert o.topology == {"zone": "b"} and o.keep == 5


def test_replicas_placement_data_parallelism():
    o = parse("nodes=4,coord=etcd://e:1,replicas=3,placement=group,listen=h:1")
    assert o.replicas == 3 and o.placement == "group"
    o = parse("nodes=8,coord=etcd://e:1,assume_data_parallelism=2,huge_model")
    assert o.assume_data_parallelism == 2 and o.huge_model and o.replicas == 1
    assert parse("replicas=0").replicas == 0
    assert parse("replicas=5").replicas == 5  # one node: replicas is ignored, not checked


def _refused_in_one_line(opts: str, words: list[str]) -> None:
    """``opts`` is refused with a one-line OptionError that contains every one of ``words``."""
    with pytest.raises(OptionError) as ei:
        parse(opts)
    msg = str(ei.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("opts,words", [
    ("rank=3,nodes=3,coord=etcd://e:1", ["rank=3", "0..2"]),
    ("rank=1", ["rank=1", "0..0"]),
    ("rank=-1", ["rank=-1"]),
    ("nodes=0", ["nodes=0"]),
    ("nodes=two", ["nodes=two"]),
    (f"nodes=2,peers={PEERS3},coord=etcd://e:1", ["peers=", "3 addresses", "nodes=2"]),
    ("nodes=3,peers=a:1;b:2,coord=etcd://e:1", ["peers=a:1;b:2", "nodes=3"]),
    ("nodes=2,peers=a:1,a:1,coord=etcd://e:1", ["peers=a:1,a:1", "a:1"]),
    ("nodes=3", ["nodes=3", "coord=etcd://"]),
    ("nodes=3,rank=1,listen=h:1", ["nodes=3", "coord=etcd://"]),
    (f"nodes=3,peers={PEERS3}", ["nodes=3", "coord=etcd://"]),
    ("nodes=2,coord=etcd://e:1,coordinator=h:7470", ["coordinator=h:7470", "gone", "coord="]),
    ("nodes=3,coord=etcd://e:1,replicas=3", ["replicas=3", "2"]),
    ("replicas=-1", ["replicas=-1"]),
    ("listen=h", ["listen=h"]),
    ("listen=h:99999", ["listen=h:99999"]),
    ("listen=::1:7470", ["listen=::1:7470", "brackets"]),
    ("coordinator=:7470", ["coordinator=:7470"]),
    ("coordinator=h:7470", ["coordinator=h:7470", "gone"]),
    ("peers=a:1,b:x", ["peers=a:1,b:x"]),
    ("peers=a:1,zone=b", ["zone=b"]),
    ("topology=zone", ["topology=zone"]),
    ("topology=zone=a,zone=b", ["topology=zone=a,zone=b", "twice"]),
    ("topology=zone=", ["topology=zone="]),
    ("topology=zone=a,bogus", ["bogus"]),
    ("placement=star", ["placement=star"]),
    ("nodes=6,coord=etcd://e:1,assume_data_parallelism=4", ["assume_data_parallelism=4", "6"]),
    ("assume_data_parallelism=0", ["assume_data_parallelism=0"]),
    ("nodes=4,coord=etcd://e:1,huge_model", ["huge_model", "assume_data_parallelism"]),
    ("nodes=4,coord=etcd://e:1,assume_data_parallelism=1,huge_model", ["huge_model"]),
    ("nodes=4,coord=etcd://e:1,assume_data_parallelism=2,huge_model,replicas=2",
     ["replicas=2", "huge_model"]),
    ("huge_model=1", ["huge_model=1"]),
    ("peers", ["peers"]),
])
def test_peer_option_errors_name_the_option(opts, words):
    _refused_in_one_line(opts, words)


# ---------------------------------------------------------------------- status output

STATUS_PEERS = {
    "rank": 0, "nodes": 3, "listen": "127.0.0.1:7471",
    "membership": {"registered": True, "error": None, "lease_ttl_s": 5},
    "replicas": 1, "placement": "ring",
    "peers": [1], "holds_for": [2], "latest_complete": {"step": "step_20", "number": 20},
    "members": [
        {"rank": 0, "address": "127.0.0.1:7471", "alive": True, "member_for_s": 12.0,
         "labels": {}},
        {"rank": 2, "address": "127.0.0.1:7473", "alive": False, "member_for_s": 31.0,
         "labels": {}}],
    "replication": [
        {"peer": 1, "address": "127.0.0.1:7472", "state": "lagging", "lag_steps": 1,
         "lag_bytes": 12 << 20, "last_replicated": "step_10",
         "last_error": "RESOURCE_EXHAUSTED: replica store full", "bytes_sent": 0,
         "chunks_skipped": 3}],
    "replica_store": {"chunks": 3, "manifests": 2, "used_bytes": 123, "corrupt_deleted": 1},
    "bad_peers": {"2": 1}, "restore": None}


def test_status_peer_section():
    text = "\n".join(format_peer_status(STATUS_PEERS))
    for want in ["rank 0 of 3", "listening on 127.0.0.1:7471, registered in etcd",
                 "step_20", "DEAD", "MEMBER FOR", "31s", "lagging", "1 step,",
                 "12.0 MiB", "step_10", "replica store full", "3 chunks, 2 manifests, 123 B",
                 "corrupt_deleted 1", "rank 2: 1"]:
        assert want in text, want
    cut = {**STATUS_PEERS, "membership": {"registered": False,
                                          "error": "not registered in etcd: no answer"}}
    assert "NOT REGISTERED in etcd (not registered in etcd: no answer)" in \
        format_peer_status(cut)[0]


def test_status_peer_section_tolerates_missing_keys():
    assert format_peer_status(None) == ["  peer tier: none (single node)"]
    assert format_peer_status({"rank": 1})[0].startswith("  peer tier: rank 1 of -")
    assert format_peer_status({"members": [{}], "replication": [{}], "replica_store": {},
                               "latest_complete": None, "bad_peers": {}, "restore": {}})


def test_scope_job_options():
    o = parse(f"rank=1,nodes=3,peers={PEERS3},scope=job,coord=etcd://e:2379")
    assert o.scope == "job" and o.coord == ["e:2379"]
    assert parse("").scope == "node"


@pytest.mark.parametrize("opts,words", [
    ("scope=cluster", ["scope=cluster", "node or job"]),
    ("scope=job", ["scope=job", "nodes >= 2"]),
    ("nodes=4,scope=job,coord=etcd://e:1,assume_data_parallelism=2",
     ["scope=job", "assume_data_parallelism"]),
    (f"rank=1,nodes=3,peers={PEERS3},scope=job", ["coord=etcd://"]),
    (f"rank=1,nodes=3,peers={PEERS3},scope=job,coord=etcd://e:1,ns_quorum=majority",
     ["ns_quorum=majority", "is gone", "etcd"]),
    ("nodes=3,coord=etcd://e:1,ns_quorum=live", ["ns_quorum=live", "is gone"]),
])
def test_scope_option_errors_name_the_option(opts, words):
    with pytest.raises(OptionError) as ei:
        parse(opts)
    for w in words:
        assert w in str(ei.value)


def test_mtc_options():
    o = parse(f"rank=1,nodes=3,peers={PEERS3},mtc,jax_coordinator=10.0.0.1:1234,coord=etcd://e:1")
    assert o.mtc and o.jax_coordinator == "10.0.0.1:1234"
    assert not parse("").mtc and parse("mtc").jax_coordinator is None


@pytest.mark.parametrize("opts,words", [
    (f"rank=1,nodes=3,peers={PEERS3},scope=job,coord=etcd://e:1,mtc", ["mtc", "scope=node"]),
    ("jax_coordinator=h:1", ["jax_coordinator=h:1", "only with option mtc"]),
    ("mtc,jax_coordinator=nohost", ["jax_coordinator=nohost"]),
])
def test_mtc_option_errors_name_the_option(opts, words):
    with pytest.raises(OptionError) as e:
        parse(opts)
    for w in words:
        assert w in str(e.value)


# ---------------------------------------------------------------------- bounds, repeats (#12)

@pytest.mark.parametrize("opts,words", [
    ("nodes=1000000000,coord=etcd://e:1", ["nodes=1000000000", "at most 65536"]),
    ("keep=1000000", ["keep=1000000", "at most 1000"]),
    ("backup=file:///b,backup_keep=99999999", ["backup_keep=99999999", "at most 100000"]),
    ("replicas=1000", ["replicas=1000", "at most 16"]),
    ("backup=file:///b,backup_interval=0", ["backup_interval=0", "at least 1s"]),
    ("backup=file:///b,backup_interval=400d", ["backup_interval=400d", "at most 30d"]),
    ("backup=file:///b,backup_interval=9999999ckpt", ["backup_interval=9999999ckpt",
                                                      "at most 1000000ckpt"]),
    ("restore=99999999999999999999999", ["restore=99999999999999999999999"]),
    ("size=99999999999999999999999999P", ["size=99999999999999999999999999P", "at most"]),
    ("size=" + "9" * 400, ["size=999", "at most"]),
    ("size=1M", ["size=1M", "chunk_size"]),
    ("keep=1_0", ["keep=1_0", "integer"]),
    ("mount_timeout=0", ["mount_timeout=0", "between 1s and 1h"]),
])
def test_out_of_range_values_are_refused(opts, words):
    """Every number has bounds that make sense; past them: a one-line error naming it."""
    _refused_in_one_line(opts, words)


def test_values_at_the_bounds_are_accepted():
    o = parse("nodes=65536,coord=etcd://e:1,keep=1000,replicas=16,size=1024P,mount_timeout=1h",
              "listen=h:1")
    assert (o.nodes, o.keep, o.replicas, o.size) == (65536, 1000, 16, 1024 ** 6)
    assert o.mount_timeout == 3600 and parse("").mount_timeout == 300
    o = parse("backup=file:///b,backup_interval=30d,backup_keep=100000")
    assert o.backup_interval.seconds == 30 * 86400 and o.backup_keep == 100000


@pytest.mark.parametrize("opts", [["size=4G,size=8G"], ["size=4G", "size=4G"],
                                  ["store=/dev/shm/a,store=/dev/shm/b"], ["keep=2,keep=3"],
                                  ["nodes=2,coord=etcd://e:1,listen=h:1", "listen=h:2"]])
def test_an_option_given_twice_is_an_error(opts):
    with pytest.raises(OptionError) as ei:
        parse(*opts)
    assert "given twice" in str(ei.value)


def test_flags_may_repeat_and_lists_still_continue():
    assert parse("debug,debug", "allow_other", "allow_other").debug
    o = parse(f"rank=1,nodes=3,peers={PEERS3},topology=zone=a,block=3,coord=etcd://e:1")
    assert len(o.peers) == 3 and o.topology == {"zone": "a", "block": "3"}
    # a list option given again starts afresh (test_topology_labels_continue_across_commas)
    assert parse("nodes=2,peers=a:1,b:1,coord=etcd://e:1", "peers=c:1,d:1").peers == ["c:1", "d:1"]


@pytest.mark.parametrize("opt,why", [("size=", "needs a value"), ("store=", "needs a value"),
                                     ("size", "needs a value"), ("keep=", "needs a value"),
                                     ("allow_other=", "takes no value"),
                                     ("debug=1", "takes no value")])
def test_empty_value_says_needs_a_value(opt, why):
    with pytest.raises(OptionError) as ei:
        parse(opt)
    assert why in str(ei.value) and opt in str(ei.value)


def test_failpoints_parse_and_refuse_what_they_do_not_know():
    from mtcfs.base.failpoints import parse
    assert parse("") == {}
    assert parse("backup.put_chunk=sleep(0.5); a=sleep(2)") == {"backup.put_chunk": 0.5, "a": 2.0}
    with pytest.raises(ValueError, match="NAME=sleep"):
        parse("backup.put_chunk=crash")


def test_coord_lists_etcd_endpoints_across_commas():
    o = parse_mount_options("j", "/m", [
        "nodes=4,rank=1,scope=job,peers=h0:1,h1:1,h2:1,h3:1,"
        "coord=etcd://e1:2379,e2:2379;e3:2379,coord_prefix=/jobs/j1/", "insecure"])
    assert o.coord == ["e1:2379", "e2:2379", "e3:2379"]
    assert o.coord_prefix == "/jobs/j1/"
    assert o.ns_quorum is None  # etcd's quorum orders the namespace
    assert o.peers == ["h0:1", "h1:1", "h2:1", "h3:1"]


@pytest.mark.parametrize("opts,words", [
    ("nodes=2,coord=etcd://e:1,coord=http://e:1", ["coord=http://e:1", "etcd://"]),
    ("coord=etcd://e:1", ["coord=etcd://e:1", "nodes >= 2"]),
    ("nodes=2,coord=etcd://e:1,coord=etcd://e:1,e:1", ["coord=etcd://e:1,e:1", "twice"]),
    ("nodes=2,coord=etcd://e:1,coord=etcd://nohost", ["coord", "nohost"]),
    ("nodes=2,coord=etcd://e:1,scope=job,ns_quorum=live,coord=etcd://e:1",
     ["ns_quorum=live", "leave ns_quorum out"]),
    ("coord_prefix=/x", ["coord_prefix=/x", "needs coord="]),
    ("nodes=2,coord=etcd://e:1,coord=etcd://e:1,coord_prefix=rel", ["coord_prefix=rel"]),
])
def test_coord_errors_name_the_option(opts, words):
    with pytest.raises(OptionError) as ei:
        parse_mount_options("j", "/m", [opts])
    msg = str(ei.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


# -- security: TLS or an explicit insecure (docs/security.md) --------------------------------

def test_default_listen_is_this_hosts_address_never_a_wildcard(monkeypatch):
    import socket
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "10.1.2.3")
    o = parse_exactly("nodes=2,coord=etcd://e:1,insecure")
    assert o.listen == f"10.1.2.3:{DEFAULT_PEER_PORT}"
    monkeypatch.setattr(socket, "gethostbyname", lambda host: "127.0.1.1")  # Debian's /etc/hosts
    with pytest.raises(OptionError) as e:
        parse_exactly("nodes=2,coord=etcd://e:1,insecure")
    assert "needs listen=HOST:PORT" in str(e.value) and "127.0.1.1" in str(e.value)
    assert "\n" not in str(e.value)


def test_multi_node_without_tls_or_insecure_is_refused():
    with pytest.raises(OptionError) as e:
        parse_exactly("nodes=2,coord=etcd://e:1,listen=h:1")
    assert "needs tls_ca=, tls_cert= and tls_key=" in str(e.value)
    assert "option insecure" in str(e.value) and "\n" not in str(e.value)
    o = parse_exactly("nodes=2,coord=etcd://e:1,listen=h:1,insecure")
    assert o.insecure and o.tls_ca is None


def test_tls_files_go_together_and_only_with_several_nodes():
    with pytest.raises(OptionError) as e:
        parse_exactly("nodes=2,coord=etcd://e:1,listen=h:1,tls_ca=/ca.pem,tls_cert=/c.pem")
    assert "needs tls_key=" in str(e.value)
    with pytest.raises(OptionError) as e:
        parse_exactly("tls_ca=/ca.pem,tls_cert=/c.pem,tls_key=/c.key")
    assert "need nodes >= 2" in str(e.value)
    o = parse_exactly("nodes=2,coord=etcd://e:1,listen=h:1,tls_ca=ca.pem,tls_cert=/c.pem,"
                      "tls_key=/c.key,insecure")  # insecure: etcd without coord_ca=
    assert o.tls_ca.startswith("/") and o.tls_ca.endswith("/ca.pem") and o.insecure


def test_plaintext_etcd_needs_insecure_and_insecure_needs_something_plaintext(tmp_path):
    from mtcfs.base.pki import JobCa
    ca = JobCa(tmp_path, "j")
    e = ca.issue("etcd-client")
    peer = "nodes=2,listen=h:1,tls_ca=/ca.pem,tls_cert=/c.pem,tls_key=/c.key"
    with pytest.raises(OptionError) as ei:
        parse_exactly(f"{peer},coord=etcd://e:1")
    assert "coord=etcd://e:1 is plaintext" in str(ei.value) and "coord_ca=" in str(ei.value)
    tls_etcd = f"coord=etcd://e:1,coord_ca={ca.ca},coord_cert={e.cert},coord_key={e.key}"
    o = parse_exactly(f"{peer},{tls_etcd}")
    assert not o.insecure and o.coord_ca == str(ca.ca)
    with pytest.raises(OptionError) as ei:
        parse_exactly(f"{peer},{tls_etcd},insecure")
    assert "insecure has nothing to allow" in str(ei.value)


def test_test_faults_is_an_off_by_default_flag():
    """test_faults (the control socket's fault hook, for tests only) is off unless given;
    it takes no value (docs/security-local.md)."""
    assert parse().test_faults is False
    assert parse("test_faults").test_faults and parse("test_faults,test_faults").test_faults
    with pytest.raises(OptionError) as ei:
        parse("test_faults=1")
    assert str(ei.value) == "bad option 'test_faults=1': takes no value"


def test_production_units_never_set_test_faults():
    """The systemd unit and the packaging notes never pass the test option."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    for f in [*root.glob("systemd/*"), *root.glob("packaging/**/*")]:
        if f.is_file():
            assert "test_faults" not in f.read_text(), f


@pytest.mark.parametrize("opts", ["", "allow_other", "allow_other,ro"])
def test_the_kernel_always_checks_modes(opts):
    """default_permissions on every mount, so that allow_other lets another user do what
    the file modes allow and no more."""
    from mtcfs.daemon import Daemon
    fuse = Daemon(parse(opts)).fuse_options()
    assert "default_permissions" in fuse
    assert ("allow_other" in fuse) == ("allow_other" in opts)
