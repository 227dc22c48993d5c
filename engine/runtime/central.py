"""The central replica: the coordinator's copy of every layer at each replication point, written atomically to
the run's directory, from which `train --resume DIR` continues a run whose coordinator died."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from engine.errors import UserError
from engine.runtime import layerstate
from engine.runtime.control import Generation, get_bytes, has_bytes, key
from engine.runtime.recovery import CENTRAL, Copy


class CentralReplica:
    """Mixin of the coordinator (engine.runtime.coordinator). Needs `store`, `plan`, `run_dir` and the run's state."""

    def _poll_central(self) -> None:
        """Collect the stages' parts of the central replica; once an iteration is whole, write it to disk."""
        gen = self.generation
        if not gen.replicate_every:
            return
        K = gen.replicate_every
        for t in range(self.central_done + K - self.central_done % K, self.committed + 1, K):
            parts = self.central.setdefault(t, {})
            for st in gen.plan.stages:
                k = key("central", t, f"{st.start}-{st.end}")
                if (st.start, st.end) not in parts and has_bytes(self.store, k):
                    parts[(st.start, st.end)] = layerstate.from_bytes(get_bytes(self.store, k, delete=True))
            covered = sorted(parts)
            if (
                covered
                and covered[0][0] == 0
                and covered[-1][1] == self.w.num_layers
                and all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
            ):
                self.central_done = t
                self._persist(t)
                for old in [x for x in self.central if x < t]:
                    del self.central[old]

    def _central_copies(self) -> list[Copy]:
        return [Copy(CENTRAL, CENTRAL, t, a, b) for t, parts in self.central.items() for a, b in parts]

    def _central_pieces(self, gen: Generation) -> dict[int, bytes]:
        out = {}
        for i, p in enumerate(gen.pieces):
            if p.source == CENTRAL:
                states = {}
                for (a, b), part in self.central[p.iteration].items():
                    states.update(layerstate.select(part, max(a, p.start), min(b, p.end)))
                out[i] = layerstate.to_bytes(states)
        return out

    def _write_run(self) -> None:
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        doc = {
            "model": self.plan.model, "method": self.plan.method, "batch_size": self.plan.batch_size,
            "cluster": self.plan.cluster.to_dict(), "options": self.opts.to_dict(), "replicate_every": self.K,
            "allreduce": self.plan.allreduce,
        }  # fmt: skip
        _atomic(self.run_dir / "run.json", json.dumps(doc, indent=2).encode())

    def _persist(self, t: int) -> None:
        if self.run_dir is None:
            return
        states = {}
        for part in self.central[t].values():
            states.update(part)
        gen = self.generation
        buf = layerstate.to_bytes({"iteration": t, "layers": states, "devices": gen.plan.device_names,
                                   "generation": gen.number})  # fmt: skip
        _atomic(self.run_dir / "central.pt", buf)


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_resume(run_dir: Path) -> tuple[dict, dict]:
    """The run document and the central replica of a run directory (for `train --resume`)."""
    try:
        doc = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot resume from {run_dir}: no readable run.json ({exc})") from None
    try:
        central = torch.load(run_dir / "central.pt", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise UserError(f"cannot resume from {run_dir}: no central replica yet ({exc})") from None
    return doc, central
