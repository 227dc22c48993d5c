"""Django admin for devices: list, filter by kind and status, search by name."""

from django.contrib import admin

from webapp.devices.models import Device


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "memory_gb", "gflops", "status", "last_heartbeat", "created_at")
    list_filter = ("kind", "status")
    search_fields = ("name",)
    readonly_fields = ("last_heartbeat", "created_at", "address", "measured", "job")
