"""App config for webapp.front."""

from django.apps import AppConfig


class FrontConfig(AppConfig):
    name = "webapp.front"
    label = "front"
    verbose_name = "Front"
