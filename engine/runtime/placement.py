"""Where a device computes (its CPU or its CUDA GPU): the one seam every tensor of its stage passes.

    place = Placement.resolve("auto")          # cuda when torch sees a GPU, else cpu; "cuda" without one: an error
    place.put(layers)                          # the stage's weights (and so its gradients and optimizer state)
    x = place.load(host_tensor)                # data and received activations onto the device
    host = place.host([t, ...])                # what goes over gloo: on the host, copied on a side stream
    timer = place.timer(); ...; start = timer.started()   # a step's start, from CUDA events on a GPU

gloo moves host tensors only (and a Jetson has no NCCL), so what crosses a cut is staged through pinned host
memory: the copies to the host run on a stream of their own and are waited for before the send is posted (the next
step is queued after that: overlapping the copy with it is left to do); received tensors go to the device with
non-blocking copies from pinned buffers. On the CPU every call is the identity or the host clock, so the path CI
runs is this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UserError
from engine.runtime.emulation import now


def cuda_available() -> bool:
    return torch.cuda.is_available()


def kind(choice: str) -> str:
    """ "cpu" or "cuda": where a run option (`auto`, `cpu`, `cuda`) computes on this host. It only asks the driver, so
    a process that calls it (the CLI's launcher) holds no CUDA context, which on a Jetson is the board's memory."""
    if choice == "cpu" or (choice == "auto" and not cuda_available()):
        return "cpu"
    if choice in ("auto", "cuda"):
        if not cuda_available():
            raise UserError(
                "--device cuda: this host's torch sees no CUDA GPU (torch.cuda.is_available() is False; "
                f"torch {torch.__version__}); use --device auto or cpu, or install a CUDA build of torch"
            )
        return "cuda"
    raise UserError(f"device must be one of auto, cpu, cuda; got {choice!r}")


def resolve(choice: str) -> torch.device:
    """The compute device a run option names, on this host (its current GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if kind(choice) == "cuda" else torch.device("cpu")


@dataclass(frozen=True)
class Accelerator:
    """What an agent reports of its host's compute device (hello): kind, GPU name and memory, shared memory."""

    device: str  # "cuda" or "cpu"
    name: str = ""  # the GPU's name ("Orin", "NVIDIA Tegra X1", ...), empty on a CPU
    memory_bytes: int = 0  # the GPU's memory (on a Jetson: the board's, shared with the CPU)
    integrated: bool = False  # the GPU shares the host's memory (a Jetson): one budget for both

    @classmethod
    def of_host(cls) -> Accelerator:
        if not cuda_available():
            return cls("cpu")
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return cls("cuda", props.name, int(props.total_memory), bool(getattr(props, "is_integrated", False)))

    def to_dict(self) -> dict:
        return {"device": self.device, "gpu": self.name, "gpu_memory": self.memory_bytes, "integrated": self.integrated}


class StepTimer:
    """A step's start on the run's clock. On a GPU, from a pair of CUDA events around its kernels: the step ends
    when its kernels have finished (waited for), and started their elapsed time before, not when they were queued."""

    def __init__(self, cuda: bool) -> None:
        self.host_start = now()
        self.events = None
        if cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()

    def started(self) -> float:
        """Call once the step's work is queued: waits for it on a GPU; returns when it started (wall seconds)."""
        if self.events is None:
            return self.host_start
        begin, end = self.events
        end.record()
        end.synchronize()
        return now() - begin.elapsed_time(end) / 1000.0


class Placement:
    """One device's compute device and the copies to and from it."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # "cuda": the current GPU, by its index (tensors carry one)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.copies = torch.cuda.Stream(self.device) if self.cuda else None  # device -> host, beside the compute
        self.integrated = self.cuda and bool(getattr(torch.cuda.get_device_properties(self.device), "is_integrated", 0))

    @classmethod
    def resolve(cls, choice: str) -> Placement:
        return cls(resolve(choice))

    @property
    def type(self) -> str:
        return self.device.type

    def describe(self) -> str:
        """ "cpu", or the GPU with its name: "cuda:0 (NVIDIA Orin)"."""
        return f"{self.device} ({torch.cuda.get_device_name(self.device)})" if self.cuda else "cpu"

    def put(self, layers: list[nn.Module]) -> None:
        """Move these layers (weights, buffers) to the device; their parameters stay the same objects."""
        for layer in layers:
            layer.to(self.device)

    def home(self, layers: list[nn.Module]) -> None:
        """Move these layers back to the host (layers this device no longer trains)."""
        if self.cuda:
            for layer in layers:
                layer.to("cpu")

    def load(self, x: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device (from pinned memory without waiting: the copy is ordered before its use)."""
        if not self.cuda or x.device == self.device:
            return x
        if not x.is_pinned():
            x = x.pin_memory()
        return x.to(self.device, non_blocking=True)

    def state(self, p: torch.Tensor, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A parameter's optimizer state where torch's optimizers keep it: beside the parameter, the step count on
        the host (as `Optimizer.load_state_dict` places it for a non-capturable optimizer)."""
        return {k: v if k == "step" else v.to(p.device) for k, v in state.items()}

    def host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """These tensors on the host, for gloo. On a GPU each is copied into pinned memory on the copy stream once the
        compute queued before has run, and those copies are waited for (not the compute queued after them)."""
        if not self.cuda or not tensors:
            return tensors
        compute = torch.cuda.current_stream(self.device)
        self.copies.wait_stream(compute)
        out = []
        with torch.cuda.stream(self.copies):
            for t in tensors:
                if t.device.type != "cuda":
                    out.append(t)
                    continue
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                out.append(buf)
        self.copies.synchronize()
        return out

    def timer(self) -> StepTimer:
        return StepTimer(self.cuda)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> tuple[int, int] | None:
        """(bytes now, peak bytes) this process holds on the GPU (torch's allocator; None on the CPU)."""
        if not self.cuda:
            return None
        return torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)

    def check_precision(self, precision: str) -> None:
        """bf16 needs a GPU that computes it (no Jetson before Orin does): fp16 is the one that runs there."""
        if self.cuda and precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name(self.device)
            raise UserError(f"--precision bf16: this GPU ({name}) has no bf16; use --precision fp16 (or fp32)")
