"""A registered model: a name users pick in the job form, and the engine reference that every board builds
(a module file's or a Hugging Face folder's absolute path, its input, and the SHA-256 its content must have)."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class LabModel(models.Model):
    name = models.SlugField(max_length=64, unique=True, help_text="What users pick in the job form.")
    reference = models.CharField(max_length=600, unique=True, editable=False)  # engine.models.source, pinned
    init = models.CharField(max_length=500, blank=True, help_text="A starting checkpoint the boards can read.")
    layers = models.JSONField(default=list, editable=False)  # the layers its graph was cut into, for the pages
    task = models.CharField(max_length=32, editable=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def digest(self) -> str:
        return self.reference.rpartition("#sha256:")[2]

    def to_dict(self) -> dict:
        return {
            "name": self.name, "reference": self.reference, "init": self.init, "task": self.task,
            "layers": self.layers, "sha256": self.digest,
        }  # fmt: skip


def reference_of(name: str) -> str:
    """What a job trains for the model `name`: a registered model's reference, else `name` itself (the zoo's)."""
    found = LabModel.objects.filter(name=name).values_list("reference", flat=True).first()
    return found or name


def name_of(reference: str) -> str:
    """The name users pick for `reference` (the job form's): a registered model's, else the reference itself."""
    return LabModel.objects.filter(reference=reference).values_list("name", flat=True).first() or reference


def init_of(reference: str) -> str | None:
    """The starting checkpoint registered with the model of `reference`, if any."""
    return LabModel.objects.filter(reference=reference).values_list("init", flat=True).first() or None
