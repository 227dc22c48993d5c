"""Devices registered with the control plane: the boards (or emulated boards) that train. Never imports jobs."""
