"""Token trees verified in one pass (`ARImageBackbone.step_tree`, `keep_tree_path`) on every backbone adapter.

A node must get exactly the hidden state `step` gives after feeding its own path (it sees the image so far and
its ancestors, never a sibling's branch), and after `keep_tree_path` the cache must continue as if the accepted
path had been fed token by token (the rejected branches gone), with the batch's images on different paths.
"""

import pytest
import torch
from tiny_adapters import ADAPTERS

from backbones.base import Condition
from backbones.digits import random_digits_backbone

FAMILIES = {
    "digits": (
        lambda: random_digits_backbone(grid_size=4, levels=8, hidden_size=32, num_layers=2, num_heads=2),
        lambda: Condition(class_ids=torch.tensor([1, 8])),
        3.0,
    ),
    **ADAPTERS,
}
# Node t follows PARENTS[t] (-1: the image so far): two branches from the next position, the first forking again.
PARENTS = torch.tensor([-1, 0, 1, -1, 3, 4, 1])
PATHS = [[3, 4, 5], [0, 1, 6]]  # the path each of the two images keeps, root first (its second branch, its fork)


def _path_to(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(PARENTS[node])
    return path[::-1]


def _reference_hidden(backbone, condition, prefix, fed):
    """What `step` gives feeding `prefix` then `fed` (B, k) token by token from a fresh prefill: (rows, H)."""
    state, hidden = backbone.prefill(condition, guided=True)
    if prefix.shape[1]:
        hidden = backbone.step(state, prefix)
    for j in range(fed.shape[1]):
        hidden = backbone.step(state, fed[:, j : j + 1])
    return hidden[:, -1]


@pytest.mark.filterwarnings("ignore:.*no codebook latents")
@pytest.mark.parametrize("where", ["row_end", "image_end"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tree_nodes_see_their_own_path_and_the_kept_path_continues_the_cache(family, where):
    make_backbone, make_condition, _ = FAMILIES[family]
    backbone, condition = make_backbone(), make_condition()
    # "row_end": the tree starts two positions before a row's end, so that families with end-of-line tokens
    # get them inside the tree; "image_end": its deepest nodes are the image's last token (scratch slots past
    # the cache sized for the image).
    count = backbone.geometry.cols - 2 if where == "row_end" else backbone.geometry.num_tokens - 3
    generator = torch.Generator().manual_seed(0)
    image = torch.randint(backbone.codebook_size, (2, backbone.geometry.num_tokens), generator=generator)
    prefix = image[:, :count]
    tokens = torch.randint(backbone.codebook_size, (2, len(PARENTS)), generator=generator)
    tokens[:, 3] = (tokens[:, 0] + 1) % backbone.codebook_size  # siblings differ
    tokens[:, 6] = (tokens[:, 2] + 1) % backbone.codebook_size

    with torch.inference_mode():
        state, _ = backbone.prefill(condition, guided=True)
        backbone.step(state, prefix)
        tree = backbone.step_tree(state, tokens, PARENTS)
        for node in range(len(PARENTS)):
            expected = _reference_hidden(backbone, condition, prefix, tokens[:, _path_to(node)])
            torch.testing.assert_close(tree.hidden[:, node], expected, atol=1e-5, rtol=1e-4, msg=f"node {node}")

        keep = 2 if where == "image_end" else 3
        backbone.keep_tree_path(state, tree, torch.tensor(PATHS), keep)
        assert state.num_image_tokens == count + keep
        kept = torch.stack([tokens[b, PATHS[b][:keep]] for b in range(2)])
        assert state.cache.get_seq_length() == state.prefix_length + backbone.geometry.flat_length(count + keep)
        following = image[:, count + keep : count + keep + 1]
        continued = backbone.step(state, following)[:, -1]
        expected = _reference_hidden(backbone, condition, prefix, torch.cat([kept, following], dim=1))
        torch.testing.assert_close(continued, expected, atol=1e-5, rtol=1e-4)


def test_a_tree_whose_parents_do_not_come_first_is_refused():
    backbone = FAMILIES["digits"][0]()
    state, _ = backbone.prefill(Condition(class_ids=torch.tensor([1])), guided=False)
    with pytest.raises(ValueError, match="parents must come first"):
        backbone.step_tree(state, torch.zeros(1, 2, dtype=torch.long), torch.tensor([1, -1]))


@pytest.mark.filterwarnings("ignore:.*no codebook latents")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_in_bfloat16_tree_nodes_differ_from_step_by_rounding_only(family):
    """In bf16 the tree pass (an explicit mask over the whole cache) rounds differently from `step` (which a
    plain pass over the same path mostly reproduces bit for bit): measured up to 1.9% of the largest hidden value
    (LlamaGen), 0.02-0.5% for the others, a few bf16 steps. Greedy tree decoding in bf16 can therefore leave greedy
    AR where two tokens' scores tie within rounding, as every lossless method does (tests/test_lossless_bf16.py).
    The bound still fails a causal mask over the nodes on 5 of the 6 adapters; the float32 test fails it on all."""
    make_backbone, make_condition, _ = FAMILIES[family]
    backbone, condition = make_backbone().to(torch.bfloat16), make_condition()
    generator = torch.Generator().manual_seed(0)
    count = backbone.geometry.cols - 2
    prefix = torch.randint(backbone.codebook_size, (2, count), generator=generator)
    tokens = torch.randint(backbone.codebook_size, (2, len(PARENTS)), generator=generator)
    with torch.inference_mode():
        state, _ = backbone.prefill(condition, guided=True)
        backbone.step(state, prefix)
        tree = backbone.step_tree(state, tokens, PARENTS)
        assert tree.hidden.dtype == torch.bfloat16
        for node in range(len(PARENTS)):
            expected = _reference_hidden(backbone, condition, prefix, tokens[:, _path_to(node)]).float()
            error = (tree.hidden[:, node].float() - expected).abs().max() / expected.abs().max()
            assert error < 0.03, f"node {node}: {float(error):.4f} of the largest hidden value"
