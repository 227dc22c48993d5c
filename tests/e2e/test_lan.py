"""End to end on a real (namespaced) LAN: the site served on the bridge address, one agent per board, each board
its own host with its own address, its own monotonic clock days apart from the others' and a 20 Mbit link
shaped by tc; faults come from the world (a pulled cable, a frozen or throttled board, a stranger on the LAN)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.e2e.lan import start_lab, stop_lab
from tests.e2e.test_recovery import ended, log_lines, planned, reached
from workers.testbed import Testbed, available

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(available() is not None, reason=f"no namespaced testbed here: {available()}"),
]

# Three boards of three kinds: clock offsets of 0, 1 and 2 days (and some), 20 Mbit links.
DEVICES = [("nx-0", "jetson-xavier-nx", "b0"), ("tx2-0", "jetson-tx2", "b1"), ("nano-0", "jetson-nano", "b2")]
JOB = {"model": "mobilenetv2", "dataset": "synthetic", "batch_size": 32, "iterations": 8}


@pytest.fixture(scope="module")
def lab(tmp_path_factory, profile_cache):
    tb = Testbed(name="aslan", boards=len(DEVICES), subnet="198.18.43.0/24", rate="20mbit")
    tb.up()
    try:
        lab = start_lab(tb, tmp_path_factory.mktemp("lab"), profile_cache, DEVICES)
        try:
            yield lab
        finally:
            stop_lab(lab)
    finally:
        tb.down()


def run_job(lab, job: dict | None = None, during=None) -> tuple[dict, list[str]]:
    """Plan and launch a job on the lab's boards; `during(job_id)` runs once iteration 2 is done. The ended job
    and its log."""
    system = lab.system
    job = planned(system, {**JOB, **(job or {})})
    assert system.api(f"/api/jobs/{job['id']}/launch/", {})["status"] == "running"
    if during is not None:
        reached(system, job["id"], 1)
        during(job["id"])
    final = ended(system, job["id"], timeout=400)
    return final, log_lines(system, job["id"])


def test_a_job_across_boards_with_clocks_days_apart_completes_with_a_whole_timeline(lab):
    final, lines = run_job(lab)
    assert final["status"] == "completed", final["message"] + "\n" + "\n".join(lines) + "\n" + lab.system.tail()
    assert [g["reason"] for g in final["generations"]] == ["start"], lines  # no spurious recovery
    devices = set(final["devices"])
    assert len(devices) >= 2, final["plan"]
    steps = lab.events(final["id"], "step")
    # every board's steps arrived, none dropped for a negative time
    assert {s["device"] for s in steps} == devices
    assert all(0 <= s["start"] <= s["end"] for s in steps), [s for s in steps if not 0 <= s["start"] <= s["end"]]
    for it in range(JOB["iterations"]):
        assert {s["device"] for s in steps if s["iteration"] == it and s["kind"] == "F"} == devices, it
    # a receive never ends before its data arrived, across boards whose clocks are days apart (a recv is the wait
    # for a micro-batch's activations or gradients: it ends once the first of the sends to it for them arrived)
    recvs = [s for s in steps if s["kind"] == "recv"]
    assert recvs
    for r in recvs:
        arrivals = [s["end"] for s in steps if s["kind"] == "send" and s["peer"] == r["device"]
                    and (s["iteration"], s["micro_batch"]) == (r["iteration"], r["micro_batch"])]  # fmt: skip
        assert arrivals, r
        assert r["end"] >= min(arrivals) - 0.01, (r, arrivals)
    # every device's row ends done; nothing happens to the job once it completed
    time.sleep(6)
    again = lab.system.api(f"/api/jobs/{final['id']}/")
    assert again["status"] == "completed" and again["generations"] == final["generations"]
    assert log_lines(lab.system, final["id"]) == lines
    states = lab.shell(
        "import json\nfrom webapp.jobs.models import JobDevice\n"
        f"print(json.dumps(sorted(set(JobDevice.objects.filter(job_id={final['id']}).values_list('state', flat=True)))))"
    )
    assert "lost" not in states, states
    for name in devices:  # the agents name the device and its generation, not "rank 0"
        assert f"device {name}" in lab.agent_log(name), lab.agent_log(name)[-2000:]

