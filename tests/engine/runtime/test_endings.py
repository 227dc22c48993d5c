"""Endings that cannot be mistaken for failures: a device that trained every iteration is never lost afterwards,
however long its part of the model takes to reach the coordinator (an agent uploading 8.8 MB at 20 Mbit/s).

Regression: on a real LAN the last stage's agent uploaded its part before relaying `device-done`; its process had
exited, its heartbeats stopped, and 2 s later the coordinator declared it lost: the job failed after every
iteration had trained, or completed with a spurious recovery."""

import time

from engine.runtime.coordinator import Coordinator
from engine.runtime.options import RunOptions
from engine.runtime.processes import DeviceProcesses
from tests.engine.runtime.helpers import cluster_of, make_plan, model_workload

MODEL = "gpt-small"
HOLD_S = 4.0  # each part takes this long to arrive: twice the detection window


class UploadingFleet(DeviceProcesses):
    """Local processes seen as a site sees its agents': a device's exit status is unknown (only its agent's report
    would tell), and `device-done` arrives HOLD_S after the device sent it (its agent was uploading the part)."""

    def __init__(self):
        super().__init__()
        self.held: list[tuple[float, dict]] = []

    def get(self, timeout: float):
        t = time.monotonic()
        if self.held and self.held[0][0] <= t:
            return self.held.pop(0)[1]
        ev = super().get(timeout)
        if ev is not None and ev.get("type") == "device-done":
            self.held.append((time.monotonic() + HOLD_S, ev))
            return None
        return ev

    def drain(self):
        yield from super().drain()

    def exitcode(self, name: str):
        code = super().exitcode(name)
        return None if code == 0 else code


def test_a_device_handing_over_its_part_slowly_is_not_lost(tmp_path):
    plan = make_plan(MODEL, cluster_of("nx", "tx2"), 4, 2, [(0, 7, [("nx-0", 2)]), (7, 15, [("tx2-1", 2)])])
    events = []
    coordinator = Coordinator(
        plan,
        model_workload(MODEL),
        RunOptions(iterations=3, emulate=False, save_model=True, timeout_s=30),
        emit=events.append,
        run_dir=tmp_path,
        replicate_every=0,
        detect_s=2.0,
        fleet=UploadingFleet(),
    )
    coordinator.run()
    kinds = [e["type"] for e in events]
    assert "device-lost" not in kinds and "replan" not in kinds, [e for e in events if e["type"] == "device-lost"]
    assert kinds.count("device-done") == 2  # both parts arrived, late as they were
    assert coordinator.store.get("asteroid/end") == b"completed"
