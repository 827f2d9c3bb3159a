"""EAGLE-2's dynamic draft tree (decode/eagle2.py): greedy is greedy AR, sampled has the backbone's distribution,
and the head's tree pass gives each node what a chain along its own path would."""

import pytest
import torch
from conftest import random_eagle_head
from distribution_check import assert_sampled_from, enumerable_backbone, image_distribution

from backbones.base import Condition
from decode.ar import generate_ar
from decode.eagle2 import Eagle2DecodeConfig, Eagle2Drafter, generate_eagle2
from decode.sampling import SamplingConfig

CLASS_ID = 2


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("config", [Eagle2DecodeConfig(), Eagle2DecodeConfig(nodes=12, depth=8, top_k=3)])
def test_greedy_eagle2_is_greedy_ar_token_for_token(tiny_backbone, batch, config):
    sampling = SamplingConfig(greedy=True, cfg_scale=3.0)
    condition = Condition(class_ids=torch.tensor([0, 3, 7, 9][:batch]))
    result = generate_eagle2(tiny_backbone, random_eagle_head(tiny_backbone), condition, sampling, config=config)
    assert torch.equal(result.tokens, generate_ar(tiny_backbone, condition, sampling).tokens)


def test_the_heads_tree_level_gives_each_node_its_own_paths_prediction(tiny_backbone):
    """A node's head state from the tree pass equals the head's chain along that node's own path: the tree
    mask shows it its ancestors, never a sibling."""
    head = random_eagle_head(tiny_backbone)
    sampling = SamplingConfig(cfg_scale=3.0)
    condition = Condition(class_ids=torch.tensor([4]))
    state, first = tiny_backbone.prefill(condition, guided=True)
    total = tiny_backbone.geometry.num_tokens
    tokens = torch.randint(0, tiny_backbone.codebook_size, (1, total), generator=torch.Generator().manual_seed(1))
    predicting = torch.randn(2, total, tiny_backbone.hidden_size, generator=torch.Generator().manual_seed(2))
    frontier = 5
    drafter = Eagle2Drafter(tiny_backbone, head, state, sampling, Eagle2DecodeConfig())
    expand = drafter.expander(frontier, tokens, predicting)
    root_out, _ = expand([0], [-1], predicting[:, frontier : frontier + 1], tokens[:, frontier : frontier + 1], 0)
    # Pool: 0 root; 1, 2 its children; 3, 4 children of 2 (so 3 and 4 see 2, not 1).
    pool_parents = [-1, 0, 0, 2, 2]
    level1_states = torch.randn(2, 2, tiny_backbone.hidden_size, generator=torch.Generator().manual_seed(3))
    level1_tokens = torch.tensor([[3, 6]])
    out1, _ = expand([1, 2], pool_parents, level1_states, level1_tokens, 1)
    level2_states = torch.randn(2, 2, tiny_backbone.hidden_size, generator=torch.Generator().manual_seed(4))
    level2_tokens = torch.tensor([[1, 2]])
    out2, _ = expand([3, 4], pool_parents, level2_states, level2_tokens, 2)
    drafter.after_tree()
    assert drafter.cache.get_seq_length() == frontier + 1

    def chain(inputs, chain_tokens):  # a fresh head cache fed the true prefix, then the path in order
        cache = head.new_cache()
        embed = lambda t: tiny_backbone.embed_image_tokens(t.repeat(2, 1))  # noqa: E731
        head(predicting[:, : frontier + 1], embed(tokens[:, : frontier + 1]), cache)
        out = None
        for state_j, token_j in zip(inputs, chain_tokens):
            out = head(state_j[:, None], embed(token_j.view(1, 1)), cache)
        return out[:, -1]

    torch.testing.assert_close(out1[:, 0], chain([level1_states[:, 0]], [level1_tokens[0, 0]]), atol=1e-5, rtol=1e-4)
    for j in range(2):  # both children of node 2 see node 2 (and not node 1)
        expected = chain([level1_states[:, 1], level2_states[:, j]], [level1_tokens[0, 1], level2_tokens[0, j]])
        torch.testing.assert_close(out2[:, j], expected, atol=1e-5, rtol=1e-4)
    assert root_out.shape == (2, 1, tiny_backbone.hidden_size)


@pytest.mark.parametrize(
    "settings",
    [{}, {"draws": "sampled", "confidence": "calibrated"}],
    ids=["point-candidates", "sampled-draws-calibrated"],
)
def test_sampled_eagle2_has_the_backbone_distribution(settings):
    backbone = enumerable_backbone(grid_size=3, levels=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    result = generate_eagle2(
        backbone, random_eagle_head(backbone, std=0.5), Condition(class_ids=torch.full((20_000,), CLASS_ID)),
        sampling, torch.Generator().manual_seed(0), Eagle2DecodeConfig(nodes=6, depth=3, top_k=2, **settings),
    )  # fmt: skip
    counts = result.extras  # first and second candidates both decide at times
    assert counts["accepted_rank_0"] > 0 and counts["accepted_rank_1"] > 0, counts
    assert_sampled_from(result.tokens.flatten(1).tolist(), image_distribution(backbone, CLASS_ID, sampling))
