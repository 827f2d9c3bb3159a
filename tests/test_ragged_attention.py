"""Ragged passes attend over each row group's own keys (backbones/ragged_attention.py); the attention they switch a
model to is transformers' SDPA everywhere else. That each image's states stay its own, row by row, on every
adapter: tests/test_ragged_pass.py."""

import random

import torch

from backbones.base import Condition
from backbones.ragged_attention import call_overhead_keys, row_groups


def test_groups_cover_every_row_once_and_read_up_to_each_rows_end():
    generator = random.Random(0)
    for _ in range(200):
        ends = [generator.randint(1, 700) for _ in range(generator.randint(1, 40))]
        groups = row_groups(ends, queries=generator.randint(1, 24))
        assert groups[0][0] == 0 and groups[-1][1] == len(ends)
        assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))  # consecutive, no row twice or left out
        assert all(first < end and keys == max(ends[first:end]) for first, end, keys in groups)


def test_a_long_row_among_short_ones_gets_a_call_of_its_own_and_like_rows_share_one():
    short, long = 50, 600
    assert row_groups([short] * 8 + [long] + [short] * 7, queries=9) == [(0, 8, short), (8, 9, long), (9, 16, short)]
    assert row_groups([400] * 16, queries=9) == [(0, 16, 400)]
    # Rows a few keys apart are not worth a call each: padding them costs less than a call.
    assert row_groups([400, 404, 398, 401], queries=9) == [(0, 4, 404)]
    assert call_overhead_keys(1) > call_overhead_keys(9) > call_overhead_keys(17) > 0


def test_a_pass_after_a_ragged_one_gives_what_it_gave_before(tiny_backbone):
    """The first ragged pass switches the backbone to the "ragged_sdpa" attention. Every other pass must compute
    what "sdpa" does, masks included: without transformers' sdpa masks registered for the new name, a KV-cached
    multi-token step got no mask and SDPA's is_causal kernel, whose diagonal starts at the first key."""
    backbone = tiny_backbone
    condition = Condition(class_ids=torch.tensor([2, 7]))
    tokens = torch.randint(0, backbone.codebook_size, (2, 12), generator=torch.Generator().manual_seed(0))

    def cached_steps():
        state, _ = backbone.prefill(condition, guided=True)
        backbone.step(state, tokens[:, :5])
        return backbone.step(state, tokens[:, 5:])  # a multi-token step over a cache

    before = cached_steps()
    ragged, _ = backbone.prefill(condition, guided=True)
    backbone.step_ragged(ragged, tokens[:, :4], torch.tensor([0, 0]))
    assert backbone.transformer.config._attn_implementation == "ragged_sdpa"
    torch.testing.assert_close(cached_steps(), before, atol=0, rtol=0)
