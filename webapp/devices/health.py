"""Devices' health over time: the figures each heartbeat brings (workers.health), stored in rounds with the
heartbeats, pruned after a day unless taken during a job, and drawn as small series on the devices page."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from webapp.devices.models import Device, HealthSample

WINDOW = timedelta(minutes=30)  # what the devices page draws
SPARK_W, SPARK_H = 120, 22


def store(beats: list[tuple[Device, dict]]) -> int:
    """One sample per heartbeat that carries health figures, in one statement; a sample taken while the agent
    ran a job is the job's (kept as long as it is). Returns how many were stored."""
    from webapp.jobs.models import Job

    told = {msg.get("job") for _, msg in beats if isinstance(msg.get("job"), int)}
    jobs = set(Job.objects.filter(pk__in=told).values_list("pk", flat=True)) if told else set()
    now = timezone.now()
    rows = [
        HealthSample(
            device_id=device.pk,
            job_id=msg.get("job") if msg.get("job") in jobs else None,
            at=now,
            **{k: msg["health"].get(k) for k in HealthSample.FIGURES},
        )  # fmt: skip
        for device, msg in beats
        if msg.get("health")
    ]
    HealthSample.objects.bulk_create(rows)
    return len(rows)


def prune() -> int:
    """Delete the samples older than ASTEROID_HEALTH_KEEP_H that no job keeps; returns how many."""
    before = timezone.now() - timedelta(hours=settings.ASTEROID_HEALTH_KEEP_H)
    deleted, _ = HealthSample.objects.filter(job__isnull=True, at__lt=before).delete()
    return deleted


def recent(devices) -> dict[int, dict]:
    """Each device's last WINDOW of health: its latest sample and CPU and memory sparklines (SVG points)."""
    since = timezone.now() - WINDOW
    samples: dict[int, list[HealthSample]] = {}
    for s in HealthSample.objects.filter(device__in=devices, at__gte=since).order_by("at"):
        samples.setdefault(s.device_id, []).append(s)
    out = {}
    for pk, rows in samples.items():
        out[pk] = {
            "latest": rows[-1],
            "cpu": sparkline([(s.at, s.cpu) for s in rows], since),
            "mem": sparkline([(s.at, s.mem_percent) for s in rows], since),
        }
    return out


def sparkline(points: list[tuple], since) -> str:
    """SVG polyline points of (time, percent) pairs over the window from `since`: x by time, y by 0-100 %."""
    span = WINDOW.total_seconds()
    xy = []
    for at, value in points:
        if value is None:
            continue
        x = (at - since).total_seconds() / span * SPARK_W
        y = SPARK_H - max(0.0, min(100.0, value)) / 100 * SPARK_H
        xy.append(f"{x:.1f},{y:.1f}")
    return " ".join(xy)


def job_figure(job) -> dict:
    """The job's devices' health while it ran, as a Plotly figure (plain JSON): CPU % solid, memory % dotted and
    GPU % dashed per device, against seconds since the job started; and one line of the latest figures (the
    chart's text alternative)."""
    samples = list(HealthSample.objects.filter(job=job).select_related("device").order_by("at"))
    start = job.started_at or (samples[0].at if samples else None)
    by_device: dict[str, list[HealthSample]] = {}
    for s in samples:
        by_device.setdefault(s.device.name, []).append(s)
    palette = ("#2d5bd7", "#c0392b", "#1f8a4c", "#b7791f", "#7b3fb5", "#16808c", "#a0522d", "#555")
    data = []
    for k, (name, rows) in enumerate(sorted(by_device.items())):
        x = [round((s.at - start).total_seconds(), 1) for s in rows]
        colour = palette[k % len(palette)]
        for figure, label, dash in (("cpu", "CPU", "solid"), ("mem_percent", "memory", "dot"), ("gpu", "GPU", "dash")):
            y = [getattr(s, figure) for s in rows]
            if all(v is None for v in y):
                continue
            data.append({"type": "scatter", "mode": "lines", "name": f"{name} {label}", "x": x, "y": y,
                         "legendgroup": name, "line": {"color": colour, "dash": dash, "width": 1.5}})  # fmt: skip
    layout = {
        "title": {"text": "CPU (solid), memory (dotted), GPU (dashed), %"},
        "xaxis": {"title": {"text": "seconds since the job started"}, "gridcolor": "rgba(128,128,128,0.25)"},
        "yaxis": {"title": {"text": "%"}, "range": [0, 100], "gridcolor": "rgba(128,128,128,0.25)"},
        "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "margin": {"t": 50, "r": 10, "b": 40, "l": 45}, "height": 340,
        "legend": {"orientation": "h", "y": -0.3, "yanchor": "top"},  # below the axis title, not over it
    }  # fmt: skip
    latest = []
    for name, rows in sorted(by_device.items()):
        s = rows[-1]
        parts = [f"CPU {s.cpu:.0f} %" if s.cpu is not None else None,
                 f"memory {s.mem_percent:.0f} %" if s.mem_percent is not None else None,
                 f"GPU {s.gpu:.0f} %" if s.gpu is not None else None,
                 f"{s.temp_c:.0f} °C" if s.temp_c is not None else None,
                 f"{s.power_w:.1f} W" if s.power_w is not None else None]  # fmt: skip
        latest.append(f"{name}: {', '.join(p for p in parts if p) or 'no figures'}")
    summary = ("Latest — " + "; ".join(latest) + ".") if latest else "No health figures from its devices yet."
    return {"figure": {"data": data, "layout": layout}, "summary": summary, "samples": len(samples)}
