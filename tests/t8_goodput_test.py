"""The goodput run (examples/goodput.py --short): the same seeded failures (rank processes
killed, a node lost and replaced) hit a job checkpointing to the throttled backup tier and
the same job on mtcfs; mtcfs's goodput must be the higher, and every strategy's final
weights and optimizer state must equal an uninterrupted run's, bit for bit. It cleans up."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from support.demo import assert_cleaned_up

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "goodput.py"

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing")


def test_goodput_short(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    import subprocess
    t0 = time.monotonic()
    png, out_json = tmp_path / "goodput.png", tmp_path / "goodput.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--short", "--seed", "1", "--png", str(png),
                        "--json", str(out_json)], capture_output=True, text=True, timeout=300,
                       check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert r.stdout.rstrip().endswith("PASS"), out
    res = {x["name"]: x for x in json.loads(out_json.read_text())["results"]}
    assert set(res) == {"backup", "mtcfs-yd", "mtcfs-base"}, out
    for name, x in res.items():
        assert x["equal"], f"{name}: final state differs from the uninterrupted run\n{out}"
        assert len(set(x["digests"].values())) == 1, out
        assert x["failures"], f"{name} met no failure\n{out}"
    # every failure kind of the short form happened, and mtcfs restored after it
    kinds = {f["kind"] for x in res.values() for f in x["failures"]}
    assert kinds == {"process", "node"}, out
    assert res["mtcfs-yd"]["goodput"] > res["backup"]["goodput"], out
    # the same job, the same failures: only the checkpoint path and interval differ
    assert res["mtcfs-yd"]["every"] < res["backup"]["every"] == res["mtcfs-base"]["every"], out
    # what the background work cost the job, from the daemons' budget (mtcfs status)
    assert res["backup"]["background_cpu_s"] is None, out
    assert all(res[n]["background_cpu_s"] > 0 for n in ("mtcfs-yd", "mtcfs-base")), out
    assert "background CPU s" in r.stdout, out
    assert png.stat().st_size > 10_000
    assert_cleaned_up(r.stdout, 2)
    assert time.monotonic() - t0 < 240, out
