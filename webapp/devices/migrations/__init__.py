"""Schema migrations for webapp.devices."""
