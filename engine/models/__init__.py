"""Model zoo: each model is an ordered list of single-tensor layers plus its input spec."""

from engine.models.spec import ModelSpec, layer_name
from engine.models.zoo import MODELS, get_model, model_names

__all__ = ["MODELS", "ModelSpec", "get_model", "layer_name", "model_names"]
