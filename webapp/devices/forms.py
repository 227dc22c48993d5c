"""The add-device form (staff)."""

from django import forms

from webapp.devices.models import Device


class DeviceForm(forms.ModelForm):
    class Meta:
        model = Device
        fields = ["name", "kind", "memory_gb", "gflops"]
