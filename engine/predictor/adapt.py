"""One device's adaptation: a correction fitted on its probe, refined by the step times it measures in training."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.predictor.features import work_mix
from engine.predictor.model import Predictor, load_predictor
from engine.predictor.probe import PROBE_BATCH, PROBE_KEYS, check

# Ridge penalties of the correction's terms: overall level and backward/forward offset almost free; the
# per-kind-of-work terms pulled toward zero, so a dozen probe points cannot overfit them.
PENALTY = np.array([1e-3, 1e-3, 0.3, 0.3, 0.3])
# A stage's measured step time counts as this many probe layers: it is the device running the very model it
# trains, so training measurements soon outweigh the probe.
STAGE_WEIGHT = 20.0


def _terms(model: str) -> np.ndarray:
    """(2 x layers, 5) correction terms of each layer, forward then backward: 1, backward?, and its shares of
    depthwise, attention and memory-bound work (dense matmul is the baseline)."""
    mix = work_mix(model)[:, 1:]
    n = len(mix)
    return np.vstack([np.column_stack([np.ones(n), np.full(n, d), mix]) for d in (0.0, 1.0)])


@dataclass
class DeviceModel:
    """Per-layer time predictions for one device: the predictor's, times exp(terms . coef), where coef is fitted
    (ridge, in log space) on observations: each probe layer, then each stage's measured step time."""

    probe: dict
    # (terms, log measured/predicted, weight)
    observations: list[tuple[list[float], float, float]] = field(default_factory=list)
    predictor: Predictor | None = None
    coef: np.ndarray = field(default_factory=lambda: np.zeros(len(PENALTY)))

    @classmethod
    def from_probe(cls, probe: dict, predictor: Predictor | None = None, adapt: bool = True) -> DeviceModel:
        """A device known only by its probe; with `adapt`, the correction is fitted on the probe's layers."""
        dm = cls(dict(check(probe)), [], predictor)
        if adapt:
            by_model: dict[str, list[int]] = {}
            for key in PROBE_KEYS:
                model, index = key.split(":")
                by_model.setdefault(model, []).append(int(index))
            for model, indices in by_model.items():
                fwd, bwd = dm.base(model, PROBE_BATCH)
                terms, n = _terms(model), len(fwd)
                for i in indices:
                    for d, pred in ((0, fwd[i]), (1, bwd[i])):
                        measured = dm.probe[f"{model}:{i}"][d]
                        dm.observations.append((terms[d * n + i].tolist(), float(np.log(measured / pred)), 1.0))
            dm._refit()
        return dm

    @property
    def _predictor(self) -> Predictor:
        return self.predictor or load_predictor()

    def base(self, model: str, micro_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """The predictor's per-sample (forward, backward) seconds, before this device's correction."""
        return self._predictor.predict(model, micro_batch, self.probe)

    def predict(self, model: str, micro_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Corrected per-sample (forward, backward) seconds of every layer; probe layers at the probe's micro-batch
        are the probe's own measurements."""
        fwd, bwd = self.base(model, micro_batch)
        factor = np.exp(_terms(model) @ self.coef)
        n = len(fwd)
        fwd, bwd = fwd * factor[:n], bwd * factor[n:]
        if micro_batch == PROBE_BATCH:
            for key in PROBE_KEYS:
                m, i = key.split(":")
                if m == model:
                    fwd[int(i)], bwd[int(i)] = self.probe[key]
        return fwd, bwd

    def update(self, model: str, first: int, last: int, micro_batch: int, forward_s: float, backward_s: float) -> None:
        """Continual learning: a stage of layers [first, last) was measured taking forward_s and backward_s per
        sample; the correction is refitted with it (the terms are the stage's time-weighted mix)."""
        fwd, bwd = self.base(model, micro_batch)
        terms, n = _terms(model), len(fwd)
        for d, pred, measured in ((0, fwd, forward_s), (1, bwd, backward_s)):
            rows = slice(d * n + first, d * n + last)
            weights = pred[first:last] * np.exp(terms[rows] @ self.coef)
            mix = (terms[rows] * weights[:, None]).sum(axis=0) / weights.sum()
            self.observations.append((mix.tolist(), float(np.log(measured / pred[first:last].sum())), STAGE_WEIGHT))
        self._refit()

    def _refit(self) -> None:
        z = np.asarray([t for t, _, _ in self.observations])
        r = np.asarray([v for _, v, _ in self.observations])
        w = np.asarray([x for _, _, x in self.observations])
        self.coef = np.linalg.solve(z.T @ (w[:, None] * z) + np.diag(PENALTY), z.T @ (w * r))

    def to_dict(self) -> dict:
        return {"probe": {k: list(v) for k, v in self.probe.items()}, "observations": self.observations}

    @classmethod
    def from_dict(cls, doc: dict) -> DeviceModel:
        dm = cls(dict(check(doc["probe"])), [(list(t), float(v), float(x)) for t, v, x in doc["observations"]])
        if dm.observations:
            dm._refit()
        return dm


def predicted_times(model: str, probe: dict, micro_batch: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-sample (forward, backward) seconds of every layer of `model` on the device that ran `probe`, adapted to
    it: what the planner uses for a device of no known kind."""
    fwd, bwd = DeviceModel.from_probe(probe).predict(model, micro_batch)
    return tuple(map(float, fwd)), tuple(map(float, bwd))
