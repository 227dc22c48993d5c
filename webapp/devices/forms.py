"""The add-device form (staff)."""

import re

from django import forms

from engine.devices import LIMITS
from webapp.devices.models import Device
from webapp.lib.fields import number

# The cluster file's maxima (engine.devices.LIMITS): a board is a few TFLOPS; anything past a PFLOPS is a typo
MAX_MEMORY_GB = LIMITS["memory_gb"][1]
MAX_GFLOPS = LIMITS["gflops"][1]


class DeviceForm(forms.ModelForm):
    # Bounded here, not only by the model's minimum: 1e306 GB made the planner's byte counts infinite.
    memory_gb = number(0.1, MAX_MEMORY_GB, label="memory (GB)", required=False, help_text="Blank: the kind's memory.")
    gflops = number(0.1, MAX_GFLOPS, label="GFLOPS", required=False, help_text="Blank: the kind's FP16 peak.")

    class Meta:
        model = Device
        fields = ["name", "kind", "memory_gb", "gflops", "group"]

    def clean_group(self) -> str:
        return clean_group(self.cleaned_data.get("group") or "")


GROUP = re.compile(r"[\w.-]{1,64}")


def clean_group(value: str) -> str:
    """A device group's name: letters, digits, . _ - (or empty: none)."""
    value = value.strip()
    if value and not GROUP.fullmatch(value):
        raise forms.ValidationError("A group is 1 to 64 letters, digits, '.', '_' or '-'.")
    return value
