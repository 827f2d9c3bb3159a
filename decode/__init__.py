"""The small inference module: generators, sampling and acceptance rules over token tensors.

Public API (stable; use it from your own scripts)::

    from decode import Condition, SamplingConfig, SSDDecodeConfig, generate_ar, generate_ssd
"""

from backbones.base import Condition
from decode.ar import generate_ar
from decode.result import GenerationResult
from decode.sampling import SamplingConfig
from decode.ssd import SSDDecodeConfig, generate_ssd

__all__ = ["Condition", "GenerationResult", "SamplingConfig", "SSDDecodeConfig", "generate_ar", "generate_ssd"]
