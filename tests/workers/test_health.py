"""A board's health as its agent samples it for each heartbeat (workers.health): from /proc and sysfs, each figure
only where the board has it."""

from workers.health import Health


def write(root, path, text):
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def test_cpu_memory_temperature_gpu_and_power_of_a_jetson(tmp_path):
    write(tmp_path, "proc/stat", "cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    write(tmp_path, "proc/meminfo", "MemTotal:        4000000 kB\nMemFree:   100 kB\nMemAvailable:    1000000 kB\n")
    write(tmp_path, "sys/class/thermal/thermal_zone0/temp", "41500\n")
    write(tmp_path, "sys/class/thermal/thermal_zone1/temp", "47000\n")
    write(tmp_path, "sys/class/thermal/thermal_zone2/temp", "-273000\n")  # a zone reading nonsense: left out
    write(tmp_path, "sys/devices/gpu.0/load", "537\n")
    write(tmp_path, "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0/in_power0_input", "2500\n")
    health = Health(str(tmp_path))
    first = health.sample()
    assert "cpu" not in first  # a share since the sample before: none yet
    assert first["mem_used"] == 3_000_000 * 1024 and first["mem_total"] == 4_000_000 * 1024
    assert first["temp_c"] == 47.0 and first["gpu"] == 53.7 and first["power_w"] == 2.5
    write(tmp_path, "proc/stat", "cpu  250 0 150 900 0 0 0 0 0 0\n")  # 200 busy of 300 more jiffies
    assert health.sample()["cpu"] == 66.7


def test_a_host_without_them_reports_what_it_has(tmp_path):
    write(tmp_path, "proc/meminfo", "MemTotal: 1000 kB\n")  # no MemAvailable: no memory figure
    assert Health(str(tmp_path)).sample() == {}
    assert {"cpu", "mem_used", "mem_total"} <= set(_twice(Health()))  # this machine's own /proc


def _twice(health):
    import time

    health.sample()
    time.sleep(0.2)  # the kernel counts CPU time in ticks: some must pass between the two
    return health.sample()
