"""Django admin for jobs: list, filter by status, read their devices and events."""

from django.contrib import admin

from webapp.jobs.models import Job, JobDevice, JobEvent


class JobDeviceInline(admin.TabularInline):
    model = JobDevice
    extra = 0
    fields = ("rank", "name", "state", "accepted", "part")
    readonly_fields = fields
    can_delete = False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "model", "owner", "status", "batch_size", "iterations", "created_at", "finished_at")
    list_filter = ("status", "model")
    search_fields = ("owner__username", "model")
    readonly_fields = ("created_at", "launched_at", "started_at", "finished_at")
    inlines = [JobDeviceInline]


@admin.register(JobEvent)
class JobEventAdmin(admin.ModelAdmin):
    list_display = ("id", "job", "device", "type", "created_at")
    list_filter = ("type",)
    readonly_fields = ("job", "device", "type", "data", "created_at")
