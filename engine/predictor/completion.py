"""Low-rank completion: the measured configurations' layer times as a matrix, a new device's row filled in from its
probe's entries.

Rows are configurations, columns every (model, micro-batch, direction, layer) they all measured; an entry is the
log seconds less the configuration's mean log probe time (its overall speed), as the regressor's target. Each
column is its mean over the configurations plus a few factors (the centred matrix's singular vectors, scaled by
their singular values): how that layer's cost moves with what distinguishes one configuration from another. A new
device's weights on those factors are fitted (ridge, least squares in effect) on its probe layers, the only
entries of its row that are known; the rest of its row follows. Where the regressor learns a layer's cost from
its features, this learns it from how the very same layer ran on the other configurations.
"""

from __future__ import annotations

import numpy as np

from engine.predictor.probe import PROBE_BATCH, PROBE_KEYS, from_measurements, probe_vector

# Ridge penalty of a device's factor weights (the factors carry their singular values, so a weight of 1 is a
# typical configuration's): small, only so that a probe that barely constrains a factor leaves it near 0.
PENALTY = 0.01

Columns = dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]  # (model, micro-batch) -> (mean, factors)


def fit_columns(doc: dict, names: list[str]) -> Columns:
    """Each (model, micro-batch) every configuration in `names` measured: (mean, factors) of its 2 x layers
    entries, forward then backward. Empty with fewer than two configurations (nothing to factor)."""
    if len(names) < 2:
        return {}
    configs = [doc["configs"][n] for n in names]
    keys = set.intersection(*({(m, mb) for m, by in c.items() for mb in by} for c in configs))
    keys = sorted(k for k in keys if len({len(c[k[0]][k[1]]) for c in configs}) == 1)  # same layers everywhere
    if not keys:
        return {}
    rows = []
    for c in configs:
        level = probe_vector(from_measurements({m: v[str(PROBE_BATCH)] for m, v in c.items()})).mean()
        row = [np.log(np.asarray(c[m][mb], dtype=float).T.ravel()) - level for m, mb in keys]
        rows.append(np.concatenate(row))
    y = np.asarray(rows)
    mean = y.mean(axis=0)
    _u, s, vt = np.linalg.svd(y - mean, full_matrices=False)
    rank = len(names) - 1  # centred rows span at most this many directions
    factors = (vt[:rank].T * s[:rank]) / np.sqrt(len(names))
    out, at = {}, 0
    for m, mb in keys:
        width = 2 * len(configs[0][m][mb])
        out[(m, int(mb))] = (mean[at : at + width], factors[at : at + width])
        at += width
    return out


def weights(columns: Columns, probe_log: np.ndarray) -> np.ndarray | None:
    """A device's factor weights from its probe's log seconds (probe_vector), or None where the columns lack a
    probe layer."""
    means, factors = [], []
    for d in (0, 1):
        for key in PROBE_KEYS:
            model, index = key.split(":")
            column = columns.get((model, PROBE_BATCH))
            if column is None:
                return None
            n = len(column[0]) // 2
            means.append(column[0][d * n + int(index)])
            factors.append(column[1][d * n + int(index)])
    f = np.asarray(factors)
    target = probe_log - probe_log.mean() - np.asarray(means)
    return np.linalg.solve(f.T @ f + PENALTY * np.eye(f.shape[1]), f.T @ target)


def complete(columns: Columns, model: str, micro_batch: int, probe_log: np.ndarray) -> np.ndarray | None:
    """Log seconds of every layer of `model` at `micro_batch`, forward then backward, on the device whose probe
    gave `probe_log`; None where no column or probe layer is known."""
    column = columns.get((model, micro_batch))
    w = weights(columns, probe_log) if column is not None else None
    if w is None:
        return None
    return column[0] + column[1] @ w + probe_log.mean()
