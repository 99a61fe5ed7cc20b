"""Built-in MoE transformer: config, router, dispatch, experts, MoE block, model."""

from spikeguard.model.config import PRESETS, ModelConfig, model_config
from spikeguard.model.dispatch import Dispatched, LocalDispatcher
from spikeguard.model.experts import SwiGLUExperts
from spikeguard.model.moe import MoEBlock
from spikeguard.model.router import Routing, TopKRouter, load_balancing_loss
from spikeguard.model.transformer import MoETransformer, ModelOutput, build_model

__all__ = [
    "PRESETS", "ModelConfig", "model_config", "Dispatched", "LocalDispatcher", "SwiGLUExperts",
    "MoEBlock", "Routing", "TopKRouter", "load_balancing_loss", "MoETransformer", "ModelOutput",
    "build_model",
]
