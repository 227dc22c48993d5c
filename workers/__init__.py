"""The device agent that runs on each Jetson (or emulates one): `python -m workers.agent`, see workers/agent.py."""
