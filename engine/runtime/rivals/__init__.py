"""Rivals: PyTorch's own DDP and torch.distributed.pipelining 1F1B, run under the runtime's time dilation so
Asteroid is measured against them in the same run.

    result = run_ddp(workload("mobilenetv2"), CLUSTERS["D"], batch_size=16, iterations=4)
    result = run_pipelining(workload("mobilenetv2"), CLUSTERS["D"], batch_size=16, micro_batches=4)

Each rival runs one process per device, like the Asteroid launcher, and pads every compute step to the
device time of `engine.steps.device_steps` of its equivalent plan (`ddp_plan`, `pipelining_plan`), so its
measured iteration time (wall / dilation) is comparable with the runtime's and with the cost model.

plans.py       the equivalent plans           sync.py        store, group, clock, iteration reports
ddp.py         DDP with a shaped comm hook    pipelining.py  PipelineStage + Schedule1F1B, padded
run.py         the parent: processes, results
"""

from engine.runtime.rivals.plans import ddp_plan, pipelining_plan
from engine.runtime.rivals.run import RivalResult, run, run_ddp, run_pipelining

__all__ = ["RivalResult", "ddp_plan", "pipelining_plan", "run", "run_ddp", "run_pipelining"]
