"""Training jobs: request, plan, run and history. Imports webapp.devices; webapp.devices never imports jobs."""
