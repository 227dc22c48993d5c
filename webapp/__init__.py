"""Asteroid's control plane: a Django project with a Celery app (imported here so tasks bind to it)."""

from webapp.celery import app as celery_app

__all__ = ["celery_app"]
