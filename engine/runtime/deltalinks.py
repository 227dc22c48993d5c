"""The device's activation-change memories (engine.deltas): one per compressed boundary it sends or receives
over, carried from generation to generation where both ends of a pair agree, committed with each iteration."""

from __future__ import annotations

import torch

from engine.deltas import DeltaMemory
from engine.plan import OFF


class DeltaLinks:
    """Mixin of the device (engine.runtime.worker). Needs its stage (`st`, `stage_plan`, `plan`, `bits_in/out`),
    the `train` group and the wait helpers (engine.runtime.waits)."""

    delta_in: DeltaMemory | None = None  # the boundary before its stage (it receives activations over it)
    delta_out: DeltaMemory | None = None  # ... and after it (it sends them)

    def _delta_samples(self, mb: int, lo: int, hi: int) -> list[int]:
        """Dataset indices of samples [lo, hi) of micro-batch `mb` of the running iteration."""
        m = self.plan.micro_batch_size
        return self.batch[mb * m + lo : mb * m + hi].tolist()

    def _take_deltas(self, start: int) -> None:
        """This generation's memories, as of `start` committed iterations. A memory built for the same boundary
        that can go back to `start` is kept, with only the peers whose own memory can too: both ends decide the
        same from one all-reduce over the plan's devices, so their copies stay equal. Everyone else starts empty."""
        plan = self.plan
        names = plan.device_names
        sides = {
            "in": (self.bits_in, self.stage_plan.start, [t.peer for t in self.st.recv_forward], self.delta_in),
            "out": (self.bits_out, self.stage_plan.end, [t.peer for t in self.st.send_forward], self.delta_out),
        }
        if not plan.delta:
            self.delta_in = self.delta_out = None
            return
        can = torch.zeros(len(names), len(names))
        me = names.index(self.name)
        for bits, layer, peers, memory in sides.values():
            if memory is not None and bits < OFF and (memory.layer, memory.cap) == (layer, plan.delta_samples):
                if memory.can_roll_back(start):
                    can[me, [names.index(p) for p in peers]] = 1.0
        self._wait(self._allreduce(can, self.train), "the start-up sync")
        kept = {}
        for side, (bits, layer, peers, memory) in sides.items():
            mutual = {p for p in peers if can[me, names.index(p)] and can[names.index(p), me]}
            if bits >= OFF:
                kept[side] = None
            elif mutual:
                memory.roll_back(start)
                memory.keep_only(mutual)
                kept[side] = memory
            else:
                kept[side] = DeltaMemory(layer, plan.delta_samples, live=start)
        self.delta_in, self.delta_out = kept["in"], kept["out"]
        self._count_deltas()

    def _commit_deltas(self, k: int, committed: bool) -> None:
        """Iteration k committed (what it staged is kept) or failed (forgotten)."""
        for memory in (self.delta_in, self.delta_out):
            if memory is not None:
                memory.commit(k) if committed else memory.discard()
        self._count_deltas()

    def _count_deltas(self) -> None:
        """The memory meter counts what the memories now hold (`_held_bytes`)."""
        if self.memory is not None:
            self.memory.static_extra(self._held_bytes())
