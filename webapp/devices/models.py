"""The Device model: one registered board, its capacity, its agent's credential and its last known state."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models, transaction

from engine.devices import KINDS, canonical_probe
from engine.devices import Device as EngineDevice
from webapp.lib.tokens import new_token, token_hash

CUSTOM = "custom"
OWN_LINK_BELOW = 0.125  # a board measured under this fraction of a job's bandwidth is planned at its own link


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
    # The agent: a single-use enrollment token until it enrolls, then its credential; both only as hashes.
    enrollment_hash = models.CharField(max_length=64, blank=True, db_index=True, editable=False)
    credential_hash = models.CharField(max_length=64, blank=True, db_index=True, editable=False)
    # Its event stream: the agent process (`session`) and the last event stored from it (duplicates are dropped).
    session = models.CharField(max_length=64, blank=True, editable=False)
    last_seq = models.BigIntegerField(default=0, editable=False)
    # The serial (hex) of the board certificate the site signed at its enrollment (webapp/sitetls.py); "" for none.
    # The store gateway admits a job's board by it; a new enrollment token or removing the device revokes it.
    cert_serial = models.CharField(max_length=40, blank=True, editable=False)
    address = models.CharField(max_length=64, blank=True, help_text="Where other devices reach its agent.")
    group = models.CharField(max_length=64, blank=True, help_text="A group a job may ask for (e.g. lab-a).")
    measured = models.JSONField(default=dict, blank=True, help_text="What its agent measured and reported.")
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

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

    @property
    def enrolled(self) -> bool:
        return bool(self.credential_hash)

    @property
    def emulated(self) -> bool:
        """Its agent emulates a board (time dilation on this host) rather than being one: the two never share a run."""
        return bool((self.measured or {}).get("emulated", False))

    @property
    def measured_memory_gb(self) -> float | None:
        """The memory its agent found on its host (GB), when it reported it."""
        value = (self.measured or {}).get("memory_bytes")
        return value / 1e9 if isinstance(value, (int, float)) and value > 0 else None

    @property
    def computes_on(self) -> str:
        """Where its agent computes, as it said on hello: "GPU NAME (N GB)", "CPU", or "" before it said."""
        m = self.measured or {}
        if m.get("compute") == "cuda":
            memory = m.get("gpu_memory")
            size = f" ({memory / 1e9:.1f} GB)" if isinstance(memory, (int, float)) and memory > 0 else ""
            return f"GPU {m.get('gpu') or 'CUDA'}{size}"
        return "CPU" if m.get("compute") == "cpu" else ""

    def computes(self, device: str) -> bool:
        """It can run a job whose Compute device is `device`: anything, unless the job asks for CUDA and its agent
        said it computes on its CPU (an agent that did not say is taken at its word, as for datasets)."""
        return device != "cuda" or (self.measured or {}).get("compute") != "cpu"

    def serves(self, dataset: str) -> bool:
        """Its agent said it has `dataset`'s data (engine.data.datasets_here); an agent that did not say (older)
        is taken at its word that it has."""
        datasets = (self.measured or {}).get("datasets")
        return datasets is None or dataset in datasets

    @property
    def available(self) -> bool:
        """Online and idle: it can take a job."""
        return self.status == self.Status.ONLINE and self.job_id is None

    @property
    def in_service(self) -> bool:
        """Online, idle or busy with a job: a job may be planned on it (launched, it waits in line for a busy one)."""
        return self.status in (self.Status.ONLINE, self.Status.BUSY)

    def issue_enrollment(self) -> str:
        """A new single-use enrollment token; the current credential stops working now (re-enrollment)."""
        token = new_token("ast_enroll")
        self.enrollment_hash, self.credential_hash, self.session, self.last_seq = token_hash(token), "", "", 0
        self.cert_serial = ""  # its certificate too: the store gateway admits no board certificate without it
        if self.status in (self.Status.ONLINE, self.Status.BUSY):
            self.status = self.Status.OFFLINE
        self.save(update_fields=["enrollment_hash", "credential_hash", "session", "last_seq", "status", "cert_serial"])
        return token

    @classmethod
    def enroll(cls, token: str) -> tuple[Device, str] | None:
        """Exchange an enrollment token for a device credential, once; None for an unknown or used token."""
        if not token:
            return None
        credential = new_token("ast_dev")
        with transaction.atomic():
            device = cls.objects.filter(enrollment_hash=token_hash(token)).first()
            # The claim is one conditional UPDATE: two agents racing with the same token cannot both win.
            if device is None or not cls.objects.filter(pk=device.pk, enrollment_hash=device.enrollment_hash).update(
                enrollment_hash="", credential_hash=token_hash(credential), session="", last_seq=0
            ):
                return None
        device.refresh_from_db()
        return device, credential

    @classmethod
    def for_credential(cls, credential: str | None) -> Device | None:
        if not credential:
            return None
        return cls.objects.filter(credential_hash=token_hash(credential)).exclude(credential_hash="").first()

    def to_dict(self) -> dict:
        return {
            "id": self.pk,
            "name": self.name,
            "kind": self.kind,
            "memory_gb": self.memory_gb,
            "gflops": self.gflops,
            "status": self.status,
            "group": self.group,
            "enrolled": self.enrolled,
            "last_heartbeat": self.last_heartbeat.isoformat() if self.last_heartbeat else None,
            "measured": self.measured,
            "job": self.job_id,
            "created_at": self.created_at.isoformat() if self.created_at else None,
        }

    def to_engine(self, bandwidth_mbps: float | None = None) -> EngineDevice:
        """The engine's view of this device for planning; like a cluster file, changed figures make it custom.
        A board whose measured link (its agent's probe) is under an eighth of the job's `bandwidth_mbps` is planned
        at its own link: the probe (8 MiB over HTTP, into a site process that may be busy) reads a fast link low,
        an unshaped gigabit veth at 211 Mbps on a loaded 2-core site, so a smaller shortfall is its noise."""
        kind = KINDS.get(self.kind)
        reserved = kind.reserved_gb if kind else 0.0
        same = kind is not None and (self.memory_gb, self.gflops) == (kind.memory_gb, kind.gflops)
        probe = ""
        if kind is None and (self.measured or {}).get("probe"):  # its agent's probe: per-layer predictions
            probe = canonical_probe(self.measured["probe"], f"device {self.name}: probe")
        link = (self.measured or {}).get("link_mbps")
        own = (
            link
            if bandwidth_mbps is not None and isinstance(link, (int, float)) and link < bandwidth_mbps * OWN_LINK_BELOW
            else None
        )
        return EngineDevice(
            self.name, self.kind if same else CUSTOM, self.memory_gb, self.gflops, reserved, probe, own
        )  # fmt: skip


class HealthSample(models.Model):
    """One heartbeat's health figures of a device (workers.health): kept a day (ASTEROID_HEALTH_KEEP_H), or as long
    as the job it was taken during (deleted with it), so a job's page still shows its boards' health."""

    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="health")
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.CASCADE, related_name="health")
    at = models.DateTimeField(db_index=True)
    cpu = models.FloatField(null=True)  # % of the host's CPU, since the heartbeat before
    mem_used = models.BigIntegerField(null=True)  # bytes
    mem_total = models.BigIntegerField(null=True)
    temp_c = models.FloatField(null=True)  # the hottest thermal zone
    gpu = models.FloatField(null=True)  # % load
    gpu_temp_c = models.FloatField(null=True)
    power_w = models.FloatField(null=True)

    FIGURES = ("cpu", "mem_used", "mem_total", "temp_c", "gpu", "gpu_temp_c", "power_w")

    class Meta:
        indexes = [models.Index(fields=["device", "at"])]
        ordering = ["at"]

    @property
    def mem_percent(self) -> float | None:
        return 100.0 * self.mem_used / self.mem_total if self.mem_used is not None and self.mem_total else None
