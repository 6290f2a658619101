"""Tier-4: the Prometheus endpoint of a real mount (``metrics=HOST:PORT``).

A real HTTP client scrapes ``/metrics`` of a running daemon and prometheus-client's parser
reads it back: the series a dashboard needs, labelled job and node, moving with what the
application did; the textfile form (``mtcfs metrics``) holds the same families. A port that
cannot be bound fails the mount with one line; a malformed address is an option error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from support.cluster import free_ports
from support.mount import MTCFS
from support.prom import Series, scrape


def _scrape(address: str) -> Series:
    return scrape(address)[0]


def _one(series: Series, name: str) -> tuple[dict[str, str], float]:
    (labels, value), = series[name].items()
    return dict(labels), value


def test_a_scrape_of_a_running_mount_shows_what_the_application_did(make_mount):
    address = f"127.0.0.1:{free_ports(1)[0]}"
    # (the daemon's path: with passthrough the kernel moves the bytes, which the byte
    # counters do not count; docs/operations.md)
    m = make_mount(size="64M", metrics=address, passthrough="no")
    before = _scrape(address)
    assert _one(before, "mtcfs_up")[1] == 1
    labels, capacity = _one(before, "mtcfs_ram_capacity_bytes")
    assert capacity == 64 * 1024 * 1024
    assert labels == {"job": "testjob", "node": socket.gethostname()}
    data = os.urandom(3 * 1024 * 1024 + 5)
    os.makedirs(m.path("step_1"))
    m.path("step_1", "shard.bin").write_bytes(data)
    m.wait_state("step_1/shard.bin", "local", timeout=60)
    after = _scrape(address)
    written = _one(after, "mtcfs_bytes_written_total")[1]
    assert written - _one(before, "mtcfs_bytes_written_total")[1] == len(data)
    assert _one(after, "mtcfs_ram_used_bytes")[1] >= len(data)
    # the textfile form: the same families, from the same status
    text = m.cli("metrics", str(m.mnt)).stdout
    names = {f.name for f in text_string_to_metric_families(text)}
    assert names >= {"mtcfs_ram_capacity_bytes", "mtcfs_ram_used_bytes", "mtcfs_bytes_written"}
    m.stop()
    try:
        urllib.request.urlopen(f"http://{address}/metrics", timeout=5)
    except OSError:
        pass  # the endpoint ends with the mount
    else:
        raise AssertionError("the metrics endpoint outlived its mount")


def test_a_port_in_use_fails_the_mount_with_one_line(shm_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (shm_dir / "mnt").mkdir()
        r = subprocess.run(MTCFS + ["j", str(shm_dir / "mnt"), "-o",
                                    f"store={shm_dir / 's'},size=64M,"
                                    f"metrics=127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"metrics=127.0.0.1:{port}" in lines[0] \
        and "cannot listen" in lines[0], r.stderr
    assert not os.path.ismount(shm_dir / "mnt")


def test_a_malformed_address_is_an_option_error(shm_dir):
    (shm_dir / "mnt").mkdir()
    r = subprocess.run(MTCFS + ["j", str(shm_dir / "mnt"), "-o",
                                f"store={shm_dir / 's'},metrics=9100"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert "metrics" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
