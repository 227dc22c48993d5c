"""Asteroid engine: model zoo, profiler, cost model, planners, simulator (torch + numpy only)."""
