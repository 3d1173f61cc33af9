"""CosyVoice2's flow-matching acoustic model: speech tokens -> 80-bin mel (see `model.FlowModel`)."""

from tts_core.flow.model import FlowModel, load_flow

__all__ = ["FlowModel", "load_flow"]
