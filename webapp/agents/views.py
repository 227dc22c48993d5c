"""Staff taking a device out of service: disabling or removing it fails the job it is running (a removed device's
agent is disconnected too). Here, not in webapp.devices, because it reaches into jobs."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from webapp.devices.agents import disconnect_agent
from webapp.devices.models import Device
from webapp.jobs.ending import device_lost


@staff_member_required
@require_POST
def device_disable(request, device_id: int):
    device = get_object_or_404(Device, pk=device_id)
    device_lost(device, "was disabled by an administrator")
    Device.objects.filter(pk=device.pk).update(status=Device.Status.DISABLED, job=None)
    messages.info(request, f"{device.name} is disabled: it takes no jobs until it is enabled.")
    return redirect("devices")


@staff_member_required
@require_POST
def device_remove(request, device_id: int):
    device = get_object_or_404(Device, pk=device_id)
    device_lost(device, "was removed by an administrator")
    disconnect_agent(device.pk)
    device.delete()
    messages.info(request, f"{device.name} is removed.")
    return redirect("devices")
