"""The device's copies of layers: restoring a generation's pieces (from itself, a peer, the central replica or the
seed), replicating at a replication point, and reporting what it holds to the coordinator."""

from __future__ import annotations

import json

import torch

from engine.costmodel import link_s
from engine.events import Restore
from engine.models.weights import initial_layers
from engine.recipe import make_optimizer, prepare
from engine.runtime import layerstate
from engine.runtime.control import Generation, gen_key, get_bytes, key, put_bytes
from engine.runtime.emulation import now
from engine.runtime.recovery import CENTRAL, SEED, Copy, neighbour

REPLICA_TAG = 1 << 20  # tags of the neighbour replica's messages (training messages use small tags)
RESTORE_TAG = 1 << 21  # restore piece i uses RESTORE_TAG + 2 i (+1 for its payload)


class Copies:
    """Mixin of the device (engine.runtime.worker). Needs `layers`, `own`, `live`, `snapshot`, `replica`,
    `optimizer`, `place`, `delta_in`, `delta_out`, `memory`, `store`, `ranks`, the `world` and `train` groups,
    `clock` and the wait helpers."""

    def _report(self, number: int) -> None:
        """Tell the coordinator which copies of which layers this device holds now."""
        copies = []
        if self.live_valid and self.own[1] > self.own[0]:
            copies.append(Copy(self.name, "live", self.live, *self.own))
        for kind, held in (("snapshot", self.snapshot), ("replica", self.replica)):
            if held is not None and held[1]:
                copies.append(Copy(self.name, kind, held[0], min(held[1]), max(held[1]) + 1))
        self.store.set(gen_key(number, "held", self.name), json.dumps([c.__dict__ for c in copies]))

    def _initial_layers(self) -> list[torch.nn.Module]:
        """The model's starting layers (the seed's, or `init`'s weights), adapted and frozen as the options say."""
        layers = initial_layers(self.spec, self.opts.seed, self.opts.init)
        prepare(self.spec, layers, self.opts)
        return layers

    def _held_bytes(self) -> int:
        """Bytes of what the device keeps besides training: its snapshot, its neighbour's replica and its
        activation-change memories (engine.deltas: kept activations and what the last iterations replaced)."""
        copies = sum(layerstate.nbytes(h[1]) for h in (self.snapshot, self.replica) if h is not None)
        return copies + sum(m.nbytes for m in (self.delta_in, self.delta_out) if m is not None)

    def _states(self, kind: str, start: int, end: int) -> layerstate.LayerStates:
        """Layers [start, end) from this device's copy of `kind`."""
        if kind == "live":
            return self._scaled(layerstate.capture(self.layers, start, end, self.optimizer))
        if kind == SEED:
            if any(start <= k < end for k in self.trained):
                return layerstate.capture(self._initial_layers(), start, end, None)
            return layerstate.capture(self.layers, start, end, None)
        held = self.snapshot if kind == "snapshot" else self.replica
        return layerstate.select(held[1], start, end)

    def _scaled(self, states: layerstate.LayerStates) -> layerstate.LayerStates:
        """The layers' copies with fp16's loss scale as it is now (engine.runtime.precision): a replay from them
        scales as the lost run did."""
        for state in states.values():
            state["x.loss_scale"] = self.precision.state()
        return states

    def _restore(self, gen: Generation) -> None:
        """Send the pieces others get from this device, receive this device's own, then put them in place."""
        sends = []
        for i, p in enumerate(gen.pieces):
            if p.source == self.name and p.to != self.name:
                data = torch.frombuffer(
                    bytearray(layerstate.to_bytes(self._states(p.kind, p.start, p.end))), dtype=torch.uint8
                )
                size = torch.tensor([data.numel()], dtype=torch.int64)
                dst = self.ranks[p.to]
                sends.append((size, self._post(self.world.send, "sending layers", [size], dst, RESTORE_TAG + 2 * i)))
                sends.append(
                    (data, self._post(self.world.send, "sending layers", [data], dst, RESTORE_TAG + 2 * i + 1))
                )
        got: layerstate.LayerStates = {}
        for i, p in enumerate(gen.pieces):
            if p.to != self.name:
                continue
            start, nbytes = now(), 0
            if p.source == self.name or p.source == SEED:
                states = self._states(p.kind, p.start, p.end)
            elif p.source == CENTRAL:
                data = get_bytes(self.store, gen_key(gen.number, "central", i))
                states, nbytes = layerstate.from_bytes(data), len(data)
            else:
                src = self.ranks[p.source]
                size = torch.zeros(1, dtype=torch.int64)
                self._wait(
                    self._post(self.world.recv, "receiving layers", [size], src, RESTORE_TAG + 2 * i),
                    f"layers from {p.source}",
                )
                data = torch.empty(int(size), dtype=torch.uint8)
                self._wait(
                    self._post(self.world.recv, "receiving layers", [data], src, RESTORE_TAG + 2 * i + 1),
                    f"layers from {p.source}",
                )
                states, nbytes = layerstate.from_bytes(data.numpy().tobytes()), int(size)
            seconds = link_s(gen.plan.cluster, nbytes, self.name) if nbytes else 0.0  # over its own link
            self.clock.pad(start, seconds, compute=False)  # the emulated link: device seconds of the transfer
            got.update(states)
            if gen.number > 0 or p.kind != SEED:
                self.emit(
                    Restore(
                        self.name, p.start, p.end, p.source, p.kind, p.iteration, nbytes, seconds, gen.number
                    ).to_message()
                )
        for _, work in sends:
            self._wait(work, "handing over layers")
        if self.name in gen.leaving:
            return
        self.live_valid = False
        held = layerstate.apply(self.layers, got)
        scales = [s["x.loss_scale"] for s in got.values() if "x.loss_scale" in s]
        if scales:  # the trained layers' scale (every copy of one iteration holds the same)
            self.precision.restore(scales[0])
        stage = next(st for st in gen.plan.stages if self.name in [s.name for s in st.devices])
        self.own = (stage.start, stage.end)
        # its stage's layers on the device it computes on, the others on the host (engine.runtime.placement)
        self.place.home(self.layers[: stage.start] + self.layers[stage.end :])
        self.place.put(self.layers[stage.start : stage.end])
        own = [p for layer in self.layers[stage.start : stage.end] for p in layer.parameters() if p.requires_grad]
        self.params = list({id(p): p for p in own}.values())  # a weight two of its layers hold (tied) once
        self.optimizer = make_optimizer(self.params, self.opts)
        for p in self.params:
            if held.get(p):  # trained before: its momentum, moments and step count go on
                self.optimizer.state[p] = self.place.state(p, held[p])
        self.live = gen.start
        self.live_valid = True
        if gen.pieces and any(p.kind != SEED for p in gen.pieces if p.to == self.name):
            self.trained.update(range(stage.start, stage.end))

    def _replicate(self, t: int) -> None:
        """Replication point (t iterations done): snapshot the own layers; each stage's first device copies
        them to the next stage's first device and to the coordinator; the device time is charged."""
        start = now()
        self.snapshot = (t, self._scaled(layerstate.capture(self.layers, *self.own, self.optimizer)))
        sender = self.st.lo == 0
        target = neighbour(self.plan, self.stage) if sender else None
        source = None
        if len(self.plan.stages) > 1:
            prev = self.plan.stages[(self.stage - 1) % len(self.plan.stages)]
            source = (
                prev.devices[0].name
                if neighbour(self.plan, (self.stage - 1) % len(self.plan.stages)) == self.name
                else None
            )
        works, seconds = [], 0.0
        if sender:
            data = layerstate.to_bytes(self.snapshot[1])
            seconds = link_s(self.cluster, len(data), self.name)
            if target is not None:
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                size = torch.tensor([payload.numel()], dtype=torch.int64)
                dst = self.ranks[target]
                works += [(size, self._post(self.train.send, "the replica", [size], dst, REPLICA_TAG))]
                works += [(payload, self._post(self.train.send, "the replica", [payload], dst, REPLICA_TAG + 1))]
            self._fault(t - 1, "replica")
            put_bytes(self.store, key("central", t, f"{self.own[0]}-{self.own[1]}"), data)
            seconds += link_s(self.cluster, len(data), self.name)
        if source is not None:
            src = self.ranks[source]
            size = torch.zeros(1, dtype=torch.int64)
            self._wait(
                self._post(self.train.recv, "the replica", [size], src, REPLICA_TAG), f"the replica from {source}"
            )
            payload = torch.empty(int(size), dtype=torch.uint8)
            self._wait(
                self._post(self.train.recv, "the replica", [payload], src, REPLICA_TAG + 1),
                f"the replica from {source}",
            )
            self.replica = (t, layerstate.from_bytes(payload.numpy().tobytes()))
            seconds = max(seconds, link_s(self.cluster, int(size), self.name, source))
        for _, work in works:
            self._wait(work, f"the replica to {target}")
        self.memory.static_extra(self._held_bytes())
        end = self.clock.pad(start, seconds, compute=False)
        self._event("send", -1, start, end, peer="replica")
