"""The real backbone families as tiny random-weight instances of their real classes, shared by the tests that
run a mechanism on every adapter (MuLo-SD's drafter, token trees)."""

import torch

from backbones.base import Condition
from backbones.emu3 import random_emu3_backbone
from backbones.janus import random_janus_backbone
from backbones.llamagen import random_llamagen_backbone
from backbones.lumina import random_lumina_backbone, tiny_lumina_prompt
from backbones.tar import random_tar_backbone


def tiny_tar():
    """Tar at 4x4 with a stand-in TA-Tok codebook (relaxed acceptance and MuLo-SD's resampler need one)."""
    backbone = random_tar_backbone(seed=0, rows=4, cols=4)
    backbone.codebook = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))  # a stand-in TA-Tok codebook
    return backbone


# name -> (tiny 4x4 backbone, a condition of two images, the family's CFG scale)
ADAPTERS = {
    "llamagen": (lambda: random_llamagen_backbone(seed=0), lambda: Condition(class_ids=torch.tensor([1, 8])), 4.0),
    "janus": (
        lambda: random_janus_backbone(seed=0),
        lambda: Condition(token_ids=torch.tensor([[1, 10, 11, 12, 13, 2], [1, 20, 21, 22, 23, 2]])),
        3.0,
    ),
    "emu3": (
        lambda: random_emu3_backbone(seed=0, rows=4, cols=4),
        lambda: Condition(
            token_ids=torch.tensor([[1, 21, 22, 23, 24, 3, 14, 20, 14, 4], [1, 25, 26, 27, 28, 3, 14, 20, 14, 4]])
        ),
        3.0,
    ),
    "lumina": (
        lambda: random_lumina_backbone(seed=0, rows=4, cols=4),
        lambda: Condition(
            token_ids=torch.tensor(
                [tiny_lumina_prompt([10, 11, 12], rows=4, cols=4), tiny_lumina_prompt([20, 21, 22], rows=4, cols=4)]
            )
        ),
        3.0,
    ),
    "tar": (
        tiny_tar,
        lambda: Condition(token_ids=torch.tensor([[5, 21, 22, 23, 24, 30, 31], [5, 25, 26, 27, 28, 30, 31]])),
        3.0,
    ),
}


def queue_of_four(condition: Condition) -> Condition:
    """A family's two conditions as a queue of four images (class ids 1, 8, 3, 5; prompts 0, 1, 1, 0)."""
    if condition.class_ids is not None:
        return Condition(class_ids=torch.tensor([1, 8, 3, 5]))
    return Condition(token_ids=condition.token_ids[[0, 1, 1, 0]])
