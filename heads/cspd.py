"""CSpD's drafters: a small continuous-token AR model of the backbone's family (the paper's), and row heads.

Continuous speculative decoding (Wang et al., 2026; MarkXCloud/CSpD) drafts with
a smaller model of the same kind as the target (MAR-B drafting for MAR-H): it
samples `gamma` tokens one after another through its own transformer and
diffusion head, on the same trajectory noise the backbone will use to verify
them (decode/cspd.py). Here the drafter of the embedded continuous digits
backbone is a `ContinuousDigitsBackbone` a few times smaller; it must share the
backbone's token grid, token size and diffusion sampling steps (the noise of
one trajectory is one vector per step), which `for_backbone` copies and
`bind` checks.

`ContinuousRowHeads` goes beyond the paper: SSD's vertical latent head on the
backbone's own states drafts a whole row of continuous tokens at once, sampled
by the backbone's own diffusion head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from backbones.digits_continuous import ContinuousDigitsBackbone, ContinuousDigitsConfig
from heads.ssd import SSDHeadConfig, SSDLatentPredictor, SSDRowAttentionPredictor


@dataclass
class CSpDDrafterConfig:
    """Shape of a CSpD drafter; stored in the export's heads.json."""

    image_size: int = 24  # the backbone's: same grid and token size
    patch_size: int = 2
    training_steps: int = 1000  # the backbone's diffusion process: trajectories share one noise vector per step
    sampling_steps: int = 25
    hidden_size: int = 96  # half the backbone's width
    num_layers: int = 2  # half its depth
    num_heads: int = 2  # head dim 48
    intermediate_size: int = 256
    head_width: int = 128
    head_depth: int = 1  # a third of the backbone's diffusion blocks: the drafter samples every token itself
    # The guidance it drafts with (decode/cspd.py). None: the run's, for a drafter trained on data with class
    # dropout; 1.0 (none): a drafter self-distilled on the backbone's guided samples has learnt them directly.
    guidance_scale: float | None = None

    def __post_init__(self):
        self.model_config()  # the architecture's own checks, at construction

    def model_config(self) -> ContinuousDigitsConfig:
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise ValueError(f"cspd drafter guidance_scale must be >= 0 or null, got {self.guidance_scale}")
        return ContinuousDigitsConfig(
            image_size=self.image_size,
            patch_size=self.patch_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            head_width=self.head_width,
            head_depth=self.head_depth,
            training_steps=self.training_steps,
            sampling_steps=self.sampling_steps,
            name="cspd-drafter",
        )

    @classmethod
    def for_backbone(cls, backbone: ContinuousDigitsBackbone, **sizes) -> CSpDDrafterConfig:
        """A drafter config that shares `backbone`'s grid, token size and diffusion steps; `sizes` set the rest."""
        c = backbone.config
        return cls(
            image_size=c.image_size,
            patch_size=c.patch_size,
            training_steps=c.training_steps,
            sampling_steps=c.sampling_steps,
            **sizes,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class CSpDDrafter(nn.Module):
    """The drafter model; decode/cspd.py drives it through the `ContinuousARBackbone` API of `model`."""

    kind = "cspd"

    def __init__(self, config: CSpDDrafterConfig):
        super().__init__()
        self.config = config
        self.model = ContinuousDigitsBackbone(config.model_config())

    def bind(self, backbone) -> None:
        """Refuse a backbone whose grid, token size or diffusion steps differ from the drafter's."""
        problems = []
        ours, theirs = self.model, backbone
        if ours.geometry != theirs.geometry:
            problems.append(
                f"grid {ours.geometry.rows}x{ours.geometry.cols} vs {theirs.geometry.rows}x{theirs.geometry.cols}"
            )
        if ours.token_dim != theirs.token_dim:
            problems.append(f"token size {ours.token_dim} vs {theirs.token_dim}")
        if ours.diffusion.noise_steps != theirs.diffusion.noise_steps:
            problems.append(
                f"diffusion noise steps {ours.diffusion.noise_steps} vs {theirs.diffusion.noise_steps} "
                "(trajectory alignment shares one noise vector per step)"
            )
        if problems:
            raise ValueError(f"the CSpD drafter does not fit {backbone.name}: {'; '.join(problems)}")


class ContinuousRowHeads(nn.Module):
    """SSD's vertical latent head for a continuous-token backbone: the state below each token of a row.

    From the backbone's state ``H[i]`` at every position of a committed row and the input embedding of the
    token there, it predicts ``H[i + cols]``, the state that conditions the token below; the backbone's own
    diffusion head then samples the whole row below in one batched run (decode/cspd_rows.py). The
    predictor is SSD's (`SSDLatentPredictor`, or `SSDRowAttentionPredictor` with ``row_attention_layers``).
    """

    kind = "cspd_rows"

    def __init__(self, config: SSDHeadConfig):
        super().__init__()
        self.config = config
        self.vertical = SSDRowAttentionPredictor(config) if config.row_attention_layers else SSDLatentPredictor(config)

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """States (..., cols, H) of a row and its tokens' embeddings (..., cols, H) -> states below (..., cols, H)."""
        return self.vertical(hidden, token_embedding)
