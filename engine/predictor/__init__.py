"""AccEPT's adaptive per-layer latency predictor: per-layer times of unseen devices from a short probe.

configs.py: the execution configurations measured on this host (real, distinct "devices"); measure.py: per-layer
forward/backward times under one; features.py: what the predictor sees of a layer and of a device; model.py: the
fitted predictor (scikit-learn gradient boosting); probe.py: the few layers a new device times; adapt.py: one
device's corrections (probe, then step times) and the per-layer tables the planner uses.
"""
