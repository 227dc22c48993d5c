"""The fitted predictor: log seconds of a layer on a device from the layer's features and the device's probe.

scikit-learn's HistGradientBoostingRegressor: the well-kept standard for small tabular regression (a few thousand
rows, mixed scales, interactions between a layer's kind of work and a device's strengths), fitted in seconds with
no GPU; scikit-learn is already a dependency (it bundles the digits dataset).
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.exceptions import InconsistentVersionWarning

from engine.predictor.completion import Columns, complete, fit_columns
from engine.predictor.features import device_features, model_matrix
from engine.predictor.measure import DATA_DIR, MEASUREMENTS, load
from engine.predictor.probe import PROBE_BATCH, from_measurements, probe_vector

MODEL_FILE = DATA_DIR / "predictor.pkl"
MODEL_VERSION = 2  # 2: with the low-rank completion (engine.predictor.completion)


def _regressor() -> HistGradientBoostingRegressor:
    return HistGradientBoostingRegressor(
        max_iter=400, learning_rate=0.05, max_leaf_nodes=15, min_samples_leaf=8, l2_regularization=0.1, random_state=0
    )


def _inputs(model: str, micro_batch: int, probe_log: np.ndarray) -> np.ndarray:
    """Rows for every layer of `model`, forward then backward: layer features, direction, device features."""
    layers = model_matrix(model, micro_batch)
    dev = np.broadcast_to(device_features(probe_log), (len(layers), len(probe_log)))
    return np.vstack([np.column_stack([layers, np.full(len(layers), d), dev]) for d in (0.0, 1.0)])


@dataclass
class Predictor:
    """Predicts per-sample forward and backward seconds of every layer of a zoo model on a device given only that
    device's probe. The target is log seconds minus the probe's mean log seconds (the device's overall speed), so
    what is learnt is each layer's cost relative to the device's speed, shaped by what the probe shows it is
    fast or slow at. Where the training set measured the layer (its model at that micro-batch), the prediction is
    the geometric mean of the regressor's and the low-rank completion's (engine.predictor.completion): two
    models that err differently (leave-one-configuration-out, median per-layer error 18.0 % and 15.3 % alone,
    14.9 % together; `bench predictor`)."""

    devices: list[str] = field(default_factory=list)
    rows: int = 0
    version: int = MODEL_VERSION
    regressor: HistGradientBoostingRegressor | None = None
    columns: Columns = field(default_factory=dict)

    @classmethod
    def fit(cls, doc: dict, exclude: tuple[str, ...] = ()) -> Predictor:
        """Fit on a measurements document (measure.py's format), leaving out the configurations in `exclude`."""
        xs, ys, devices = [], [], []
        for name, per_model in sorted(doc["configs"].items()):
            if name in exclude:
                continue
            try:
                probe = from_measurements({m: v[str(PROBE_BATCH)] for m, v in per_model.items()})
            except KeyError:
                continue  # a configuration measured without every probe layer cannot be described: skipped
            plog = probe_vector(probe)
            devices.append(name)
            for model, by_batch in per_model.items():
                for mb, times in by_batch.items():
                    xs.append(_inputs(model, int(mb), plog))
                    t = np.asarray(times, dtype=float)
                    ys.append(np.log(np.concatenate([t[:, 0], t[:, 1]])) - plog.mean())
        if not xs:
            raise ValueError("no configuration has every probe layer measured: nothing to fit")
        x, y = np.vstack(xs), np.concatenate(ys)
        return cls(devices, len(y), MODEL_VERSION, _regressor().fit(x, y), fit_columns(doc, devices))

    def predict(self, model: str, micro_batch: int, probe: dict) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) per-sample seconds of each layer of `model` on the device that measured `probe`."""
        plog = probe_vector(probe)
        y = self.regressor.predict(_inputs(model, micro_batch, plog)) + plog.mean()
        completed = complete(self.columns, model, micro_batch, plog)
        if completed is not None:
            y = (y + completed) / 2
        y = np.exp(y)
        n = len(y) // 2
        return y[:n], y[n:]


def fit_and_save(path: Path = MODEL_FILE, measurements: Path = MEASUREMENTS) -> Predictor:
    predictor = Predictor.fit(load(measurements))
    path.write_bytes(pickle.dumps(predictor))
    return predictor


@lru_cache(maxsize=1)
def load_predictor() -> Predictor:
    """The stored predictor (data/predictor.pkl); refitted from measurements.json when the file is missing or
    was made by another version of it or of scikit-learn (a few seconds)."""
    try:
        with warnings.catch_warnings():  # a model pickled by another scikit-learn may predict wrongly: refitted
            warnings.simplefilter("error", InconsistentVersionWarning)
            predictor = pickle.loads(MODEL_FILE.read_bytes())
        if isinstance(predictor, Predictor) and predictor.version == MODEL_VERSION:
            return predictor
    except (OSError, pickle.UnpicklingError, AttributeError, ImportError, EOFError, TypeError, ValueError):
        pass
    except InconsistentVersionWarning:
        pass
    return Predictor.fit(load(MEASUREMENTS))
