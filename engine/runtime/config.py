"""What one device process is given: `DeviceConfig`, and the one generation of a run without a coordinator."""

from __future__ import annotations

from dataclasses import dataclass

from engine.plan import Plan
from engine.runtime.control import Generation
from engine.runtime.faults import Fail
from engine.runtime.options import RunOptions
from engine.runtime.recovery import SEED, Piece
from engine.steps import DeviceSteps


@dataclass(frozen=True)
class DeviceConfig:
    """Everything one device process needs to take part in a run: the run's options and its own place in it."""

    plan: Plan  # the first plan of the run (a coordinated device gets each generation's plan from the store)
    steps: DeviceSteps | None
    rank: int
    host: str
    port: int
    options: RunOptions = RunOptions()
    serve_store: bool = False  # this process hosts the rendezvous store (rank 0 when there is no coordinator)
    predicted_iteration_s: float = 1.0  # device seconds; bounds how long a healthy device may wait for data
    coordinated: bool = False  # a coordinator drives generations through the store (the launcher)
    name: str = ""  # coordinated: this device's name (a device that joins later is in no plan yet)
    fails: tuple[Fail, ...] = ()  # injected failures of this device
    address: str = ""  # the address this board's data plane binds to and advertises (its route to the site)
    time_base: dict | None = None  # this board's clock against the site's (offset_s, drift_ppm, ref_s); None: same host

    @property
    def world_size(self) -> int:
        return len(self.plan.device_names)

    @property
    def device_name(self) -> str:
        return self.name or self.steps.name


def static_generation(cfg: DeviceConfig) -> Generation:
    """The one generation of a run without a coordinator: the plan as given, from the seed."""
    plan, opts = cfg.plan, cfg.options
    pieces = tuple(
        Piece(s.name, st.start, st.end, SEED, SEED, 0)
        for st in plan.stages
        for s in st.devices
        if s.name == cfg.steps.name
    )
    return Generation(
        number=opts.generation, plan=plan, steps={cfg.steps.name: cfg.steps}, start=0, iterations=opts.iterations,
        pieces=pieces, predicted_iteration_s=cfg.predicted_iteration_s, replicate_every=0, dilation=opts.dilation,
    )  # fmt: skip
