"""Device pages: the list everyone reads; staff add, enable and re-enroll devices (disable and remove, which fail
the device's job, are in webapp.agents.views)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from webapp.accounts.auth import staff_required
from webapp.devices import health
from webapp.devices.agents import disconnect_agent
from webapp.devices.api import agent_command
from webapp.devices.forms import DeviceForm
from webapp.devices.models import Device


@login_required
def device_list(request):
    """The devices; `?rows=1` is the table alone, which the page re-reads every few seconds."""
    template = "devices/_table.html" if request.GET.get("rows") == "1" else "devices/list.html"
    devices = list(Device.objects.select_related("job"))
    seen = health.recent(devices)
    for d in devices:
        d.recent_health = seen.get(d.pk)
    return render(request, template, {"devices": devices, "health_minutes": int(health.WINDOW.total_seconds() // 60)})


@staff_required
def device_add(request):
    form = DeviceForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        device = form.save()
        return _enrollment_page(request, device, device.issue_enrollment())
    return render(request, "devices/add.html", {"form": form})


def _enrollment_page(request, device: Device, token: str):
    context = {"device": device, "token": token, "command": agent_command(request, token)}
    return render(request, "devices/enrollment.html", context)


@staff_required
@require_POST
def device_token(request, device_id: int):
    device = get_object_or_404(Device, pk=device_id)
    token = device.issue_enrollment()
    disconnect_agent(device.pk)
    return _enrollment_page(request, device, token)


@staff_required
@require_POST
def device_group(request, device_id: int):
    """Put a device in a group (or none): a job may ask for a group's devices instead of naming them."""
    from django import forms

    from webapp.devices.forms import clean_group

    device = get_object_or_404(Device, pk=device_id)
    try:
        group = clean_group(request.POST.get("group", "")[:200])
    except forms.ValidationError as exc:
        messages.error(request, f"{device.name}: {exc.messages[0]}")
        return redirect("devices")
    Device.objects.filter(pk=device.pk).update(group=group)
    messages.info(request, f"{device.name} is in group {group}." if group else f"{device.name} is in no group.")
    return redirect("devices")


@staff_required
@require_POST
def device_enable(request, device_id: int):
    device = get_object_or_404(Device, pk=device_id)
    # Offline until its agent speaks again; a running agent reconnects by itself.
    Device.objects.filter(pk=device.pk).update(status=Device.Status.OFFLINE)
    messages.info(request, f"{device.name} is enabled; it is online once its agent reports.")
    return redirect("devices")
