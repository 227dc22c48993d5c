"""A LAN of namespaced boards on one Linux machine, with faults from the world: see docs/testbed.md."""

from workers.testbed.faults import Saturation, Testbed
from workers.testbed.net import Board, TestbedError, available

__all__ = ["Board", "Saturation", "Testbed", "TestbedError", "available"]
