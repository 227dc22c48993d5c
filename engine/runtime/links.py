"""The device's messages to its neighbouring stages: every receive of an iteration posted at its start, and sends
that queue on the emulated outgoing link (a float64 header with the emulated arrival time, then the payload).
A training iteration's activations over a boundary with a delta memory (engine.runtime.deltalinks) cross as
changes; an evaluation's never do (its samples are the held-out split's)."""

from __future__ import annotations

import torch

from engine.compression import decode, encode, wire_bytes
from engine.costmodel import link_s
from engine.plan import OFF, gradient_bits
from engine.runtime.emulation import now


class Links:
    """Mixin of the device (engine.runtime.worker). Needs its stage (`st`, `plan`, `shape_in/out`, `bits_in/out`),
    where it computes (`place`), `ranks`, the `train` group, `clock`, `link_free`, the delta memories
    (engine.runtime.deltalinks) and the wait helpers (engine.runtime.waits)."""

    def _tag(self, micro_batch: int, kind: str, part: int) -> int:
        return (micro_batch * 2 + (kind == "B")) * 2 + part

    def post_receives(self, backward: bool = True, base: int = 0) -> dict:
        """Post every receive of the iteration now; returns (kind, mb) -> [(transfer, header, payload, works)]."""
        pending = {}
        for mb in range(self.plan.micro_batches):
            for kind, moves, shape in (
                ("F", self.st.recv_forward, self.shape_in),
                ("B", self.st.recv_backward if backward else (), self.shape_out),
            ):
                got = []
                bits = self.bits_in if kind == "F" else gradient_bits(self.bits_out)
                wire = self.precision.wire_in if kind == "F" else self.precision.wire_out
                delta = self.delta_in if kind == "F" and base == 0 else None
                for t in moves:
                    peer = self.ranks[t.peer]
                    header = torch.zeros(1, dtype=torch.float64)
                    if delta is not None:  # changes for the samples both ends keep, the others whole
                        samples = self._delta_samples(mb, t.lo, t.hi)
                        payload = torch.empty(delta.wire_bytes(t.peer, samples, shape, bits), dtype=torch.uint8)
                    elif bits < OFF:  # the encoded bytes of the slice (engine.compression)
                        payload = torch.empty(wire_bytes((t.hi - t.lo, *shape), bits), dtype=torch.uint8)
                    else:  # float32, or the run's 16 bits (engine.runtime.precision)
                        payload = torch.empty((t.hi - t.lo, *shape), dtype=wire or torch.float32)
                    what = f"receiving from {t.peer}"
                    works = [
                        self._post(self.train.recv, what, [header], peer, base + self._tag(mb, kind, 0)),
                        self._post(self.train.recv, what, [payload], peer, base + self._tag(mb, kind, 1)),
                    ]
                    got.append((t, header, payload, works, delta))
                pending[(kind, mb)] = got
        return pending

    def receive(self, pending: dict, kind: str, mb: int) -> torch.Tensor | None:
        """Wait for every slice of (kind, mb), and until the emulated link delivered it; the slices in order."""
        got = pending.pop((kind, mb))
        if not got:
            return None
        start = now()
        arrival = 0.0
        for t, header, _, works, _ in got:
            for w in works:
                self._wait(w, f"{'activations' if kind == 'F' else 'gradients'} from {t.peer}")
            arrival = max(arrival, float(header[0]))
        end = self.clock.wait_until(arrival)
        if end - start > 1e-4:
            self._event("recv", mb, start, end)
        bits, shape = (self.bits_in, self.shape_in) if kind == "F" else (gradient_bits(self.bits_out), self.shape_out)
        parts = [  # on the host (gloo's), then onto the device the stage computes on (engine.runtime.placement)
            p.float() if bits >= OFF
            else delta.decode(t.peer, self._delta_samples(mb, t.lo, t.hi), p, shape, bits) if delta is not None
            else decode(p, (t.hi - t.lo, *shape), bits)
            for t, _, p, _, delta in got
        ]  # fmt: skip
        return self.place.load(torch.cat(parts) if len(parts) > 1 else parts[0])

    def send(self, tensor: torch.Tensor, moves, kind: str, mb: int, outbox: list, base: int = 0) -> None:
        """Send each peer its slice without waiting: the sends queue on the device's emulated outgoing link (one
        at a time, each its transfer time), and the device computes on meanwhile, as gloo's sends let it."""
        # activations go to the next stage over the boundary after this one, gradients back over the one before
        bits = self.bits_out if kind == "F" else gradient_bits(self.bits_in)
        delta = self.delta_out if kind == "F" and base == 0 else None
        # the slices on the host (from a GPU: copied beside its compute, engine.runtime.placement)
        hosted = self.place.host([tensor[t.lo - self.st.lo : t.hi - self.st.lo].detach().contiguous() for t in moves])
        for t, payload in zip(moves, hosted):
            payload = payload.float().contiguous()
            self.sent_payload_bytes += payload.numel() * payload.element_size()  # its float32 size
            if bits >= OFF:  # float32, or the run's 16 bits (engine.runtime.precision)
                wire = self.precision.wire_out if kind == "F" else self.precision.wire_in
                payload = self.precision.to_wire(payload, wire)
            elif delta is not None:
                payload = delta.encode(t.peer, self._delta_samples(mb, t.lo, t.hi), payload, bits)
            elif bits < OFF:  # gradients are rounded stochastically: unbiased, so SGD still follows the true mean
                # drawn from (seed, stage, iteration, micro-batch, slice) alone: a run repeats exactly, a replay too
                draw = (((self.opts.seed * 1_000_003 + self.stage) * 10_007 + self.iteration) * 1_009 + mb) * 65_537
                draw += t.lo
                self.codec_rng.manual_seed(draw % (1 << 63))
                payload = encode(payload, bits, stochastic=kind == "B", generator=self.codec_rng)
            self.sent_bytes += payload.numel() * payload.element_size()
            # the link carries the real payload: latency + bytes / bandwidth, in device seconds
            seconds = link_s(self.cluster, payload.numel() * payload.element_size(), self.name, t.peer)
            start = max(now(), self.link_free)  # after the sends queued before it
            arrival = start + self.clock.wall(seconds) if self.clock.emulated else 0.0
            self.link_free = arrival
            header = torch.tensor([arrival], dtype=torch.float64)
            peer = self.ranks[t.peer]
            what = f"sending to {t.peer}"
            for part, tensor_part in enumerate((header, payload)):
                work = self._post(self.train.send, what, [tensor_part], peer, base + self._tag(mb, kind, part))
                outbox.append((t.peer, tensor_part, work))  # the tensor stays alive until the send completes
            self._fault(self.iteration, "send")
            self._event("send", mb, start, arrival if self.clock.emulated else now(), peer=t.peer)
