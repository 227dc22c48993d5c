"""The Device model: one registered board, its capacity and its last known state."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from engine.devices import KINDS
from engine.devices import Device as EngineDevice

CUSTOM = "custom"


class Device(models.Model):
    """A board known to the control plane. For a Jetson kind, blank memory/speed are filled from the kind."""

    class Status(models.TextChoices):
        ONLINE = "online", "Online"
        BUSY = "busy", "Busy"
        OFFLINE = "offline", "Offline"
        FAILED = "failed", "Failed"
        DISABLED = "disabled", "Disabled"

    KIND_CHOICES = [(k.key, k.label) for k in KINDS.values()] + [(CUSTOM, "Custom")]

    name = models.CharField(max_length=64, unique=True)
    kind = models.CharField(max_length=32, choices=KIND_CHOICES, default="jetson-nano")
    memory_gb = models.FloatField(
        "memory (GB)", validators=[MinValueValidator(0.1)], blank=True, help_text="Blank: the kind's memory."
    )
    gflops = models.FloatField(
        "GFLOPS", validators=[MinValueValidator(0.1)], blank=True, help_text="Blank: the kind's FP16 peak."
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OFFLINE)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.get_kind_display()}, {self.status})"

    def clean(self) -> None:
        kind = KINDS.get(self.kind)
        if self.memory_gb is None and kind:
            self.memory_gb = kind.memory_gb
        if self.gflops is None and kind:
            self.gflops = kind.gflops
        missing = {f: "Required for a custom device." for f in ("memory_gb", "gflops") if getattr(self, f) is None}
        if missing:
            raise ValidationError(missing)

    def save(self, *args, **kwargs) -> None:
        # Code paths that skip full_clean() (scripts, agents) get the same defaults as the admin form.
        kind = KINDS.get(self.kind)
        if kind and self.memory_gb is None:
            self.memory_gb = kind.memory_gb
        if kind and self.gflops is None:
            self.gflops = kind.gflops
        super().save(*args, **kwargs)

    def to_dict(self) -> dict:
        return {
            "id": self.pk,
            "name": self.name,
            "kind": self.kind,
            "memory_gb": self.memory_gb,
            "gflops": self.gflops,
            "status": self.status,
            "last_heartbeat": self.last_heartbeat.isoformat() if self.last_heartbeat else None,
            "created_at": self.created_at.isoformat() if self.created_at else None,
        }

    def to_engine(self) -> EngineDevice:
        """The engine's view of this device for planning; like a cluster file, changed figures make it custom."""
        kind = KINDS.get(self.kind)
        reserved = kind.reserved_gb if kind else 0.0
        same = kind is not None and (self.memory_gb, self.gflops) == (kind.memory_gb, kind.gflops)
        return EngineDevice(self.name, self.kind if same else CUSTOM, self.memory_gb, self.gflops, reserved)
