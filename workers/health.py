"""This board's health, sampled with each heartbeat: CPU and memory use (/proc, on every Linux board), the
hottest thermal zone, and where the board has them its GPU's load and the power drawn (a Jetson's sysfs, as
tegrastats reads it; `nvidia-smi` on a desktop GPU). A figure the board cannot give is left out."""

from __future__ import annotations

import glob
import shutil
import subprocess
from pathlib import Path

# A Jetson's GPU load in tenths of a percent (the path differs between JetPack releases), and its INA3221
# power monitors' total input in milliwatts.
JETSON_GPU_LOAD = ("/sys/devices/gpu.0/load", "/sys/devices/platform/gpu.0/load", "/sys/devices/17000000.gv11b/load")
JETSON_POWER = "/sys/bus/i2c/drivers/ina3221*/*/iio:device*/in_power0_input"
NVIDIA_SMI_TIMEOUT_S = 2.0


class Health:
    """Samples of this host: CPU use since the previous sample, so one per heartbeat."""

    def __init__(self, root: str = "/") -> None:
        self.root = Path(root)
        self._cpu: tuple[int, int] | None = None
        self._smi = shutil.which("nvidia-smi")

    def sample(self) -> dict:
        """{"cpu": %, "mem_used": bytes, "mem_total": bytes, "temp_c": °C, "gpu": %, "power_w": W}, each only
        when this host has it (cpu from the second sample on)."""
        out = {}
        cpu = self._cpu_percent()
        if cpu is not None:
            out["cpu"] = cpu
        out.update(self._memory())
        temp = self._temperature()
        if temp is not None:
            out["temp_c"] = temp
        out.update(self._gpu())
        return out

    def _read(self, path: str) -> str | None:
        try:
            return (self.root / path.lstrip("/")).read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def _cpu_percent(self) -> float | None:
        text = self._read("/proc/stat")
        if not text or not text.startswith("cpu "):
            return None
        fields = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
        idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])
        before, self._cpu = self._cpu, (idle, total)
        if before is None or total <= before[1]:
            return None
        return round(100.0 * (1 - (idle - before[0]) / (total - before[1])), 1)

    def _memory(self) -> dict:
        text = self._read("/proc/meminfo") or ""
        kib = {}
        for line in text.splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable") and rest.split():
                kib[name] = int(rest.split()[0])
        if len(kib) < 2:
            return {}
        return {"mem_used": (kib["MemTotal"] - kib["MemAvailable"]) * 1024, "mem_total": kib["MemTotal"] * 1024}

    def _temperature(self) -> float | None:
        hottest = None
        for path in glob.glob(str(self.root / "sys/class/thermal/thermal_zone*/temp")):
            try:
                value = int(Path(path).read_text()) / 1000
            except (OSError, ValueError):
                continue
            if -40 < value < 150 and (hottest is None or value > hottest):  # (a zone reading nonsense: left out)
                hottest = value
        return None if hottest is None else round(hottest, 1)

    def _gpu(self) -> dict:
        for path in JETSON_GPU_LOAD:
            text = self._read(path)
            if text and text.strip().isdigit():
                out = {"gpu": round(int(text) / 10, 1)}
                watts = []
                for path in glob.glob(str(self.root / JETSON_POWER.lstrip("/"))):
                    try:
                        watts.append(int(Path(path).read_text()) / 1000)
                    except (OSError, ValueError):
                        continue
                if watts:
                    out["power_w"] = round(sum(watts), 2)
                return out
        if self._smi and self.root == Path("/"):
            return _nvidia_smi(self._smi)
        return {}


def _nvidia_smi(smi: str) -> dict:
    """The first GPU's load, temperature and power from nvidia-smi (NVML's command line); {} when it fails."""
    try:
        line = subprocess.run(
            [smi, "--query-gpu=utilization.gpu,temperature.gpu,power.draw", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True,
        ).stdout.splitlines()[0]  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    out = {}
    for name, text in zip(("gpu", "gpu_temp_c", "power_w"), line.split(","), strict=False):
        try:  # "[N/A]" where a GPU does not report it
            out[name] = float(text)
        except ValueError:
            continue
    return out
