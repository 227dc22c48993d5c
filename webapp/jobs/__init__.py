"""Training jobs: request, plan, run and history."""
