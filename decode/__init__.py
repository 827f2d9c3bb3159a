"""The small inference module: generators, sampling and acceptance rules over token tensors.

Public API (stable; use it from your own scripts)::

    from decode import Condition, SamplingConfig, SSDDecodeConfig, generate_ar, generate_ssd
    from decode import RaggedSSDConfig, generate_ssd_ragged                # batches: ragged frontiers, a queue
    from decode import MuLoDecodeConfig, generate_mulo
    from decode import CSpDConfig, generate_continuous_ar, generate_cspd   # continuous-token backbones
    from decode import CSpDMARConfig, generate_cspd_mar                   # MAR (backbones.mar.load_mar_backbone)
"""

from backbones.base import Condition
from decode.ar import generate_ar
from decode.continuous_ar import generate_continuous_ar
from decode.cspd import CSpDConfig, generate_cspd
from decode.cspd_mar import CSpDMARConfig, generate_cspd_mar
from decode.mulo import MuLoDecodeConfig, generate_mulo
from decode.result import GenerationResult
from decode.sampling import SamplingConfig
from decode.ssd import SSDDecodeConfig, generate_ssd
from decode.ssd_ragged import RaggedSSDConfig, generate_ssd_ragged

__all__ = [
    "CSpDConfig",
    "CSpDMARConfig",
    "Condition",
    "GenerationResult",
    "MuLoDecodeConfig",
    "RaggedSSDConfig",
    "SamplingConfig",
    "SSDDecodeConfig",
    "generate_ar",
    "generate_continuous_ar",
    "generate_cspd",
    "generate_cspd_mar",
    "generate_mulo",
    "generate_ssd",
    "generate_ssd_ragged",
]
