"""When a batch does not fit: what the model's state takes, what the devices offer, and a batch size that fits."""

from __future__ import annotations

from dataclasses import dataclass

from engine.devices import GIB
from engine.planners import NoFeasiblePlan, Problem, make_plan


@dataclass(frozen=True)
class Infeasible:
    """Why `method` has no plan that fits, as numbers; each front end phrases the fix in its own terms."""

    model: str
    batch_size: int
    cluster: str  # its name
    method: str
    state_bytes: int  # weights, gradients and optimizer state, before any activation
    usable_bytes: int  # every device's usable memory, together
    fitting_batch_size: int | None  # the largest batch size (halving from batch_size) that fits; None: not even 1
    where: str = ""  # how messages name the cluster (Cluster.label)

    @property
    def summary(self) -> str:
        """What does not fit, with the numbers; the advice (the batch size to ask for) is the front end's."""
        return (
            f"model {self.model!r} at batch size {self.batch_size} does not fit in {self.where or repr(self.cluster)} "
            f"with method {self.method} (weights, gradients and optimizer state take {self.state_bytes / GIB:.2f} "
            f"GiB before activations; the devices have {self.usable_bytes / GIB:.2f} GiB usable in all)"
        )


def could_fit(problem: Problem) -> bool:
    """False when no plan of any method can fit, whatever its stages: a check of the sums, before planning.

    A plan runs every sample of a micro-batch (at least batch / max_micro_batches of them) through every layer.
    A device of a stage over layers [i, j) holds that stage's weights, gradients and optimizer state, and per
    sample of its share the activations saved for at least one micro-batch in flight plus the layers' peak
    (engine.costmodel.device_memory). Summed over the devices, the stages' state adds up to the model's, their
    saved activations to the model's, and their peaks to at least the largest layer's: so the devices together
    need at least this, whatever the split, schedule or compression."""
    w, L = problem.workload, problem.workload.num_layers
    samples = -(-problem.batch_size // problem.max_micro_batches)  # in the largest micro-batch count's micro-batch
    need = w.static_bytes(0, L) + samples * (w.saved(0, L) + w.peak(0, L))
    return need <= sum(d.memory_bytes for d in problem.cluster.devices)


def diagnose(problem: Problem, method: str) -> Infeasible:
    """Plan `method` at half the batch size, then half again, until a plan fits (or batch size 1 does not); a
    batch size that could not fit (`could_fit`) is passed over unplanned, so a huge one is answered at once."""
    w, cluster = problem.workload, problem.cluster
    fitting = None
    batch = problem.batch_size // 2
    while batch >= 1:
        smaller = Problem(w, cluster, batch)
        try:
            if could_fit(smaller) and make_plan(method, smaller).predicted.fits:
                fitting = batch
                break
        except NoFeasiblePlan:
            pass
        batch //= 2
    return Infeasible(
        model=w.model,
        batch_size=problem.batch_size,
        cluster=cluster.name,
        method=method,
        state_bytes=w.static_bytes(0, w.num_layers),
        usable_bytes=sum(d.memory_bytes for d in cluster.devices),
        fitting_batch_size=fitting,
        where=cluster.label,
    )
