"""App config for webapp.devices."""

from django.apps import AppConfig


class DevicesConfig(AppConfig):
    name = "webapp.devices"
    label = "devices"
    verbose_name = "Devices"
