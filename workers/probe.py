"""What this device is: its kind, measured speed and memory (or an emulated kind's), and its LAN address."""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.devices import GIB, get_kind

BENCH_S = 0.3  # a fraction of a second of matmuls: enough for a stable figure, short enough for every start
CUSTOM = "custom"


@dataclass(frozen=True)
class Capacity:
    """The figures an agent reports in `hello`."""

    kind: str
    emulated: bool
    memory_bytes: int
    gflops: float  # effective: the emulated kind's peak, else what the host measured
    host_gflops: float
    # A board of no known kind: its latency-predictor probe (engine.predictor.probe), so the site can plan with
    # per-layer predictions for it instead of one GFLOPS figure. None for known kinds and emulated ones.
    probe: dict | None = None
    # Where its device processes compute (engine.runtime.placement, `--device auto`): "cuda" with the GPU's name and
    # memory (a Jetson's is the board's, shared with its CPU), or "cpu".
    compute: str = "cpu"
    gpu: str = ""
    gpu_memory: int = 0

    def to_dict(self) -> dict:
        doc = asdict(self)
        probe = doc.pop("probe")
        if probe is not None:
            doc["probe"] = {k: list(v) for k, v in probe.items()}
        return doc


def measure(emulate: str | None = None) -> Capacity:
    """Benchmark the host; with `emulate` (a kind or alias) report that kind's speed and memory instead. A host with a
    GPU is measured by a child process: the agent itself never holds a CUDA context, which on a Jetson would keep
    a few hundred MB of the board's one memory from its training for as long as the agent runs."""
    import torch

    if torch.cuda.is_available():  # (asks the driver; no context is made)
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as child:
            return child.apply(_measure, (emulate,))
    return _measure(emulate)


def _measure(emulate: str | None) -> Capacity:
    from engine.runtime.placement import Accelerator

    host = matmul_gflops()
    gpu = Accelerator.of_host()
    where = {"compute": gpu.device, "gpu": gpu.name, "gpu_memory": gpu.memory_bytes}
    if emulate:
        kind = get_kind(emulate)
        return Capacity(kind.key, True, int(kind.memory_gb * GIB), kind.gflops, host, **where)
    kind = board_kind()
    probe = None
    if kind == CUSTOM:  # no known kind: a few layers timed here (seconds) let the predictor fill in every other
        from engine.predictor.configs import Config
        from engine.predictor.probe import run_probe

        probe = run_probe(Config("here", device=gpu.device))  # where its stages will compute (synchronised on a GPU)
    return Capacity(kind, False, memory_bytes(), host, host, probe, **where)


def matmul_gflops(n: int = 512, seconds: float = BENCH_S) -> float:
    """Float32 matmul GFLOP/s of the host (on its GPU when it has one), from `seconds` of n x n products."""
    import torch  # lazily: command-line mistakes are reported without the cost of importing torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    (a @ b).sum().item()  # warm-up: kernels, allocator, thread pool
    sync()
    count, start = 0, time.perf_counter()
    while True:
        a @ b
        count += 1
        if count % 4 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2 * n**3 * count / elapsed / 1e9


def memory_bytes() -> int:
    """Memory training can use: the GPU's total on CUDA, else MemTotal of /proc/meminfo (shared on a Jetson)."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[1])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024  # the figure is in kB
    raise OSError("/proc/meminfo has no MemTotal line")


def board_kind() -> str:
    """The Jetson kind named by the device tree (e.g. "NVIDIA Jetson Xavier NX Developer Kit"), else custom."""
    try:
        model = Path("/proc/device-tree/model").read_text(errors="replace").lower()
    except OSError:
        return CUSTOM
    for needle, key in (("xavier nx", "jetson-xavier-nx"), ("tx2", "jetson-tx2"), ("nano", "jetson-nano")):
        if "jetson" in model and needle in model:
            return key
    return CUSTOM


def local_address(host: str, port: int) -> str:
    """The local IP this machine uses to reach `host`: a UDP socket's connect picks the route, sending nothing.
    IPv4 first: that is what the other boards' rendezvous clients are most likely to reach."""
    for family in (socket.AF_INET, socket.AF_UNSPEC):
        try:
            family, _, _, _, addr = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return "127.0.0.1"  # no route or no DNS right now; the next connect asks again
