"""Views of the browser pages."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from webapp.devices.models import Device
from webapp.front.clusters import builtin_cluster_rows


@login_required
def home(request):
    """Registered devices and the engine's built-in clusters."""
    return render(request, "home.html", {"devices": Device.objects.all(), "clusters": builtin_cluster_rows()})
