"""Staff taking a device out of service. Disabling stops new jobs only (a job it runs goes on with it); removing a
device that takes part in a running job is a graceful leave of that job (its layers are handed over at the next
iteration boundary) and disables it, so that no new job takes it before it is removed again, and removing an idle
one deletes it and disconnects its agent. Here, not in webapp.devices, because it reaches into jobs."""

from __future__ import annotations

from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from webapp.accounts.auth import staff_required
from webapp.devices.agents import disconnect_agent
from webapp.devices.models import Device
from webapp.jobs.actions import TAKING_PART, ActionError, remove_device
from webapp.jobs.models import Job, JobDevice


@staff_required
@require_POST
def device_disable(request, device_id: int):
    device = get_object_or_404(Device, pk=device_id)
    Device.objects.filter(pk=device.pk).update(status=Device.Status.DISABLED)
    running = f"; it goes on with job {device.job_id}" if device.job_id else ""
    messages.info(request, f"{device.name} is disabled: it takes no new jobs until it is enabled{running}.")
    return redirect("devices")


@staff_required
@require_POST
def device_remove(request, device_id: int):
    device = get_object_or_404(Device, pk=device_id)
    row = JobDevice.objects.filter(device=device, job__status__in=Job.ACTIVE, state__in=TAKING_PART).first()
    if row is not None:
        try:
            remove_device(row.job, row.name, request.user)
        except ActionError as exc:
            messages.error(request, f"{device.name} cannot leave job {row.job_id} now: {exc}")
            return redirect("devices")
        # Held back from new jobs from now on (a job it runs goes on with it, as when disabled), so that once it
        # has left it is not picked again before the second remove deletes it; enabling it keeps it instead.
        Device.objects.filter(pk=device.pk).update(status=Device.Status.DISABLED)
        messages.info(request, f"{device.name} leaves job {row.job_id} at the next iteration boundary, its layers "
                               "handed over, and is disabled: it takes no new jobs. Remove it again once it has left "
                               "to delete it, or enable it to keep it.")  # fmt: skip
        return redirect("devices")
    disconnect_agent(device.pk)
    device.delete()
    messages.info(request, f"{device.name} is removed.")
    return redirect("devices")
