"""Time-dilated emulation of an edge device on the host: padded compute, shaped links, late steps, memory budget.

A device step that takes `d` seconds on the real board is padded to `dilation * d` wall seconds on the
host; a step whose real compute already took longer is "late" (the host was too slow to emulate it
honestly) and is counted. Links are shaped the same way: a transfer that takes `t` device seconds keeps
the sender busy `dilation * t` wall seconds and the receiver may not use the data before then. Device
time is wall time divided by the dilation. Without a dilation (a real board) nothing is padded.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import torch

from engine.devices import GIB
from engine.errors import UserError

# Headroom over the worst contended host/device time ratio when the dilation is calibrated automatically.
SAFETY = 2.0


_base = {"offset_s": 0.0, "drift_ppm": 0.0, "ref_s": 0.0}  # this host's monotonic clock -> the run's time base


def use_time_base(estimate: dict | None) -> None:
    """Express `now()` in the run's time base: the site's monotonic clock, by this board's estimate of its offset
    and drift (an agent's `workers.clock.ClockSync.to_dict()`); None: this host's own clock (one-host runs)."""
    _base.update(offset_s=0.0, drift_ppm=0.0, ref_s=0.0)
    if estimate:
        _base.update({k: float(estimate[k]) for k in _base})


def now() -> float:
    """The run's clock, shared by every process of the run: CLOCK_MONOTONIC, which every process of a host shares,
    shifted into the site's time base on a board that is a host of its own (`use_time_base`). Every time that
    crosses a host (the start-up sync, step times, emulated link arrivals, fault times) is read from it."""
    t = time.monotonic()
    return t + _base["offset_s"] + _base["drift_ppm"] * 1e-6 * (t - _base["ref_s"])


class Clock:
    """Turns device seconds into wall seconds and pads steps; counts late steps."""

    def __init__(self, dilation: float | None):
        if dilation is not None and not dilation > 0:
            raise UserError(f"dilation must be positive, got {dilation}")
        self.dilation = dilation
        self.late = 0
        self.steps = 0
        self.overrun_s = 0.0  # wall seconds late steps ran past their targets

    @property
    def emulated(self) -> bool:
        return self.dilation is not None

    def wall(self, device_s: float) -> float:
        return device_s * self.dilation if self.dilation is not None else 0.0

    def device(self, wall_s: float) -> float:
        return wall_s / self.dilation if self.dilation is not None else wall_s

    def pad(self, start: float, device_s: float, compute: bool = True) -> float:
        """Wait until `start + dilation * device_s`; a compute step that is already past it is late."""
        if compute:
            self.steps += 1
        if self.dilation is None:
            return now()
        target = start + self.dilation * device_s
        t = now()
        if t > target:
            if compute:
                self.late += 1
                self.overrun_s += t - target
            return t
        time.sleep(target - t)
        return target

    def wait_until(self, wall_time: float) -> float:
        t = now()
        if self.dilation is not None and wall_time > t:
            time.sleep(wall_time - t)
            return wall_time
        return t


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_dilation(ratio: float, processes: int, cores: int | None = None) -> float:
    """A dilation for the worst host/device time ratio measured with the host to itself: `processes`
    devices share `cores` cores, so a step may take processes / cores times longer when all compute."""
    contention = max(1.0, processes / (cores or host_cores()))
    return max(1.0, ratio * contention * SAFETY)


def measure_ratio(
    step: Callable[[], tuple[float, float]], forward_s: float, backward_s: float, store, rank: int, world: int
) -> float:
    """The worst host/device time ratio over the devices of a run: each process in turn, ordered by rank
    through the rendezvous `store`, runs `step` (one forward and backward of its part, returning their
    real seconds) while the others wait. Runs before the process group exists, whose timeout depends on it."""
    step()  # warm-up: the allocator, lazy initialisation
    if rank > 0:
        store.wait([f"calibration/{rank - 1}"])
    runs = [step() for _ in range(2)]
    real_f, real_b = min(f for f, _ in runs), min(b for _, b in runs)
    store.set(f"calibration/{rank}", repr(max(real_f / max(forward_s, 1e-9), real_b / max(backward_s, 1e-9))))
    store.wait([f"calibration/{r}" for r in range(world)])
    return max(float(store.get(f"calibration/{r}")) for r in range(world))


def group_timeout(timeout_s: float, dilation: float | None, iteration_s: float) -> float:
    """Seconds a healthy device may wait in a group operation: the timeout plus three (dilated) iterations,
    since a device idle in the pipeline's bubble waits for most of an iteration."""
    return timeout_s + 3 * (dilation or 1.0) * iteration_s


class DeviceOutOfMemory(UserError):
    """An emulated device held more bytes than its budget."""


class MemoryMeter:
    """Counts the bytes a device really holds: weights, the trained ones' gradients and optimizer state and, per
    micro-batch in flight, the tensors autograd saved for the backward pass (each storage once, weights excluded),
    and the copies it keeps (`held`: its snapshot, its neighbour's replica and its activation-change memories).

    On a GPU (`place`, engine.runtime.placement) the stage's bytes are what torch's allocator holds for this process
    (`torch.cuda.memory_allocated`, its peak since the stage began), and the host-held copies count too where the GPU
    shares the board's memory (a Jetson: one budget for both)."""

    def __init__(
        self, device: str, budget: int | None, weights: list[torch.Tensor], trained: list[torch.Tensor],
        optimizer_states: int, held: int = 0, place=None,
    ):  # fmt: skip
        self.device = device
        self.budget = budget
        self.place = place if place is not None and place.cuda else None
        if self.place is not None:
            self.place.reset_peak()
        size = lambda ps: sum(p.numel() * p.element_size() for p in {id(p): p for p in ps}.values())  # noqa: E731
        self.training = size(weights) + size(trained) * (1 + optimizer_states)
        self.static = self.training + held
        self._params = {p.untyped_storage().data_ptr() for p in weights}
        self._held: dict[int, int] = {}
        self.peak = self.static if self.place is None else 0
        self._check()

    @property
    def current(self) -> int:
        if self.place is not None:
            return self.place.allocated()[0] + self._host_held()
        return self.static + sum(self._held.values())

    def _host_held(self) -> int:
        return self.static - self.training if self.place.integrated else 0

    def measure(self) -> int:
        """The peak so far (on a GPU, read from its allocator now), the budget not enforced: training is over."""
        self._update()
        return self.peak

    @contextlib.contextmanager
    def forward(self, micro_batch: int) -> Iterator[None]:
        """Count what autograd saves while the block runs the forward of `micro_batch`."""
        seen: set[int] = set()
        self._held[micro_batch] = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._params and ptr not in seen:
                seen.add(ptr)
                self._held[micro_batch] += storage.nbytes()
            # Without its grad_fn: a node saving its own output would otherwise hold it through this Python object,
            # a cycle through the graph that only a backward freeing the graph breaks. The zero-bubble schedules'
            # input-gradient pass keeps the graph (retain_graph), and every micro-batch's stayed in memory.
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._check()

    def static_extra(self, held: int) -> None:
        """The fault-tolerance copies now take `held` bytes."""
        self.static = self.training + held
        self._check()

    def release(self, micro_batch: int) -> None:
        self._held.pop(micro_batch, None)

    def _update(self) -> int:
        used = self.current
        self.peak = max(self.peak, used if self.place is None else self.place.allocated()[1] + self._host_held())
        return used

    def _check(self) -> None:
        used = self._update()
        if self.budget is not None and used > self.budget:
            raise DeviceOutOfMemory(
                f"device {self.device} ran out of memory: it holds {used / GIB:.2f} GiB "
                f"({len(self._held)} micro-batch(es) in flight) but has {self.budget / GIB:.2f} GiB; "
                "plan with a smaller batch size or more devices"
            )
