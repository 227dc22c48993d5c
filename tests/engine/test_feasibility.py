"""Feasibility advice: the numbers behind "does not fit", and the largest halved batch size that does."""

import random

from engine.devices import load_cluster
from engine.planners import NoFeasiblePlan, Problem, make_plan
from engine.planners.feasibility import diagnose
from tests.engine.instances import layered_workload


def fits(w, cluster, batch_size: int) -> bool:
    try:
        return make_plan("asteroid", Problem(w, cluster, batch_size)).predicted.fits
    except NoFeasiblePlan:
        return False


def test_the_largest_halved_batch_size_that_fits():
    w, cluster = layered_workload(random.Random(0), 4, act_scale=100.0), load_cluster("D")
    why = diagnose(Problem(w, cluster, 1024), "asteroid")
    assert (why.model, why.batch_size, why.cluster, why.method) == (w.model, 1024, "D", "asteroid")
    assert why.state_bytes == w.static_bytes(0, w.num_layers)
    assert why.usable_bytes == sum(d.memory_bytes for d in cluster.devices)
    assert why.fitting_batch_size == 256
    assert fits(w, cluster, 256) and not fits(w, cluster, 512)


def test_no_batch_size_fits():
    w = layered_workload(random.Random(0), 4, act_scale=2000.0)
    assert diagnose(Problem(w, load_cluster("D"), 64), "asteroid").fitting_batch_size is None
