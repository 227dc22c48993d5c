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


def diagnose(problem: Problem, method: str) -> Infeasible:
    """Plan `method` at half the batch size, then half again, until a plan fits (or batch size 1 does not)."""
    w, cluster = problem.workload, problem.cluster
    fitting = None
    batch = problem.batch_size // 2
    while batch >= 1:
        try:
            if make_plan(method, Problem(w, cluster, batch)).predicted.fits:
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
