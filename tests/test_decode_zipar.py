"""ZipAR: its pass schedule, position-addressed passes, and the preset."""

import pytest
import torch

from backbones.base import Condition
from backbones.digits import random_digits_backbone
from backbones.kv_cache import preallocated_cache, writing_at
from backbones.lumina import random_lumina_backbone, tiny_lumina_prompt
from decode.ar import generate_ar
from decode.sampling import SamplingConfig
from decode.zipar import ZipARDecodeConfig, generate_zipar


def _tiny_digits():
    return random_digits_backbone(
        seed=0, grid_size=8, levels=8, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )


@pytest.mark.parametrize("window", [1, 2, 5, 8, 20])
def test_rows_start_window_passes_apart(window):
    """The first row takes C passes, each later row starts min(w, C) passes after the one above and takes C."""
    backbone = _tiny_digits()
    result = generate_zipar(
        backbone,
        Condition(class_ids=torch.tensor([1, 4])),
        SamplingConfig(cfg_scale=3.0),
        None,
        ZipARDecodeConfig(window),
    )
    rows, cols = 8, 8
    assert result.forward_passes == 2 * cols + (rows - 2) * min(window, cols)
    assert result.tokens.shape == (2, rows, cols) and int(result.tokens.min()) >= 0


def test_end_of_line_families_start_rows_from_their_end_of_line_token():
    backbone = random_lumina_backbone(seed=0)  # 3x4 grid with an end-of-line token per row
    condition = Condition(token_ids=torch.tensor([tiny_lumina_prompt([20, 21])]))
    sampling = SamplingConfig(cfg_scale=3.0, greedy=True)
    result = generate_zipar(backbone, condition, sampling, None, ZipARDecodeConfig(window=1))
    assert result.forward_passes == 2 * 4 + 1 * 1
    assert torch.equal(
        generate_zipar(backbone, condition, sampling, None, ZipARDecodeConfig(window=4)).tokens,
        generate_ar(backbone, condition, sampling).tokens,
    )


def test_position_addressed_writes_overwrite_and_leave_zeros():
    cache = preallocated_cache(num_layers=1, capacity=6)
    layer = cache.layers[0]
    first = torch.ones(1, 1, 2, 3)
    layer.update(first, first)  # appended: slots 0, 1
    with writing_at(cache, torch.tensor([4])):
        keys, _ = layer.update(torch.full((1, 1, 1, 3), 2.0), torch.full((1, 1, 1, 3), 2.0))
    assert keys.shape[2] == 6  # every slot is returned; the mask decides what a query sees
    assert keys[0, 0, :, 0].tolist() == [1, 1, 0, 0, 2, 0]
    with writing_at(cache, torch.tensor([4])):
        keys, _ = layer.update(torch.full((1, 1, 1, 3), 3.0), torch.full((1, 1, 1, 3), 3.0))
    assert keys[0, 0, 4, 0] == 3 and cache.get_seq_length() == 5


def test_a_window_of_zero_is_refused():
    with pytest.raises(ValueError, match="window must be >= 1"):
        ZipARDecodeConfig(window=0)
