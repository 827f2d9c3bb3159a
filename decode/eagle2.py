"""EAGLE-2 decoding (Li et al., EMNLP 2024): the EAGLE head's dynamic draft tree, verified in one pass.

Paper: "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees";
code: github.com/SafeAILab/EAGLE (``model/cnets.py`` ``topK_genrate`` grows the
tree, ``model/utils.py`` ``evaluate_posterior`` verifies it). The head is
EAGLE's (heads/eagle.py, ``python -m train +experiment=eagle_digits``); only
drafting and verification differ from decode/eagle.py's chain:

1. the head catches up on the positions whose states became final (their true
   states and tokens, through its KV cache), which also gives its prediction
   after the root (the token the backbone gave last);
2. the tree grows by the draft's confidence (decode/draft_tree.py,
   `grow_tree`): each depth expands the `top_k` nodes of highest joint
   confidence (the sum of the head's log-probabilities along the path) in one
   head call, where each node attends to the final positions and its own
   ancestors (a tree mask over scratch slots of the head's cache, RoPE at the
   node's grid position); every candidate goes into a pool, and the tree is
   the `nodes` best of it ("rerank"). The authors' defaults: 60 nodes, 6
   levels, top-10 candidates per node;
3. one backbone pass verifies the tree (`ARImageBackbone.step_tree`), the path
   is accepted by multi-candidate speculative sampling with point proposals
   (`walk_tree`; EAGLE-2's ``evaluate_posterior`` tests each candidate against
   the target and zeroes a rejected candidate's mass before the next), and the
   cache keeps the path only (decode/tree_decoding.py).

Exact: greedy output is greedy AR's tokens, sampled output has the backbone's
distribution (decode/draft_tree.py). Batching: decode/tree_decoding.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backbones.base import ARImageBackbone, Condition
from backbones.hf_loading import positional_arguments
from backbones.kv_cache import reserve, writing_at
from decode.draft_tree import TreeShape
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.sampling import SamplingConfig
from decode.tree_decoding import generate_by_trees
from heads.eagle import EagleHead


@dataclass(frozen=True)
class Eagle2DecodeConfig:
    """EAGLE-2's tree size: total_token, depth and top_k of the authors' code (their defaults)."""

    nodes: int = 60  # tree nodes per verification pass, the root included (EAGLE-2's total_token)
    depth: int = 6  # tree levels after the root (draft steps per pass)
    top_k: int = 10  # candidates per expanded node, and nodes expanded per level
    # "draft" (EAGLE-2: nodes ranked by the head's probability of their tokens) or "calibrated" (by the acceptance
    # rate measured so far in this image, decode/draft_tree.py's AcceptanceModel; not the authors')
    confidence: str = "draft"
    # "top_k" (EAGLE-2: the head's most likely tokens, tested as point proposals) or "sampled" (draws without
    # replacement from the head's draft distribution, the first one EAGLE-1's draft; not the authors')
    draws: str = "top_k"
    # "fixed": every pass verifies `nodes`; "cost": at most `nodes`, only those whose expected tokens pay for
    # their place in the pass at this machine's measured pass cost (decode/tree_budget.py; not the authors')
    budget: str = "fixed"

    def __post_init__(self):
        TreeShape(self.nodes, self.depth, self.top_k, self.top_k, self.draws)  # its checks
        if self.depth < 1:
            raise ValueError(f"eagle2 depth must be >= 1 (draft steps per pass), got {self.depth}")
        if self.confidence not in ("calibrated", "draft"):
            raise ValueError(f"eagle2 confidence must be 'calibrated' or 'draft', got {self.confidence!r}")
        if self.budget not in ("fixed", "cost"):
            raise ValueError(f"eagle2 budget must be 'fixed' or 'cost', got {self.budget!r}")


def generate_eagle2(
    backbone: ARImageBackbone,
    head: EagleHead,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: Eagle2DecodeConfig = Eagle2DecodeConfig(),
) -> GenerationResult:
    """Generate one image per condition by EAGLE-2 draft trees (see the module docstring)."""
    return generate_by_trees(
        backbone, condition, sampling, generator, lambda state: Eagle2Drafter(backbone, head, state, sampling, config)
    )


class Eagle2Drafter:
    """The EAGLE head as a `TreeDrafter` (decode/tree_decoding.py)."""

    def __init__(self, backbone: ARImageBackbone, head: EagleHead, state, sampling: SamplingConfig, config):
        self.backbone, self.head, self.config = backbone, head, config
        self.total = backbone.geometry.num_tokens
        self.cache = head.new_cache()
        self.cached = 0  # head cache entries from true inputs (positions < cached)
        self.twins = 2 if state.guided else 1
        self.score_draft = backbone.draft_scorer(state, sampling.cfg_scale)
        self.dtype = head.fc.weight.dtype
        self.calibrated = config.confidence == "calibrated"
        self.cost_aware = config.budget == "cost"

    def shape(self, frontier: int) -> TreeShape:
        depth = min(self.config.depth, self.total - 1 - frontier)
        return TreeShape(self.config.nodes, depth, self.config.top_k, self.config.top_k, self.config.draws)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed_image_tokens(tokens.repeat(self.twins, 1)).to(self.dtype)

    def expander(self, frontier: int, tokens: torch.Tensor, predicting: torch.Tensor):
        head, cache = self.head, self.cache
        slot_of = {0: frontier}  # pool node -> its head cache slot (the root's entry is a true one)

        def expand(nodes, pool_parents, states, node_tokens, depth):
            out_dtype = states.dtype
            if depth == 0:  # 1. catch up on the final positions; the last output predicts the root's next
                span = slice(self.cached, frontier + 1)
                out = head(predicting[:, span].to(self.dtype), self._embed(tokens[:, span]), cache)[:, -1:]
                self.cached = frontier + 1
            else:  # 2. a tree level at scratch slots, each node seeing the final positions and its ancestors
                start = cache.get_seq_length()
                slots = torch.arange(start, start + len(nodes), device=states.device)
                width = reserve(cache, max(self.total, start + len(nodes)))
                visible = torch.zeros(len(nodes), width, dtype=torch.bool, device=states.device)
                visible[:, : frontier + 1] = True
                seen_rows, seen_slots = [], []  # each node sees its own slot and its ancestors' (one write)
                for row, node in enumerate(nodes):
                    slot_of[node] = start + row
                    ancestor = pool_parents[node]
                    while ancestor > 0:
                        seen_rows.append(row)
                        seen_slots.append(slot_of[ancestor])
                        ancestor = pool_parents[ancestor]
                    seen_rows.append(row)
                    seen_slots.append(start + row)
                visible[
                    torch.tensor(seen_rows, device=states.device), torch.tensor(seen_slots, device=states.device)
                ] = True
                positions = torch.full((len(nodes),), frontier + depth, device=states.device)
                positional = positional_arguments(states.shape[0], slots, visible, positions)
                with writing_at(cache, slots):
                    out = head(states.to(self.dtype), self._embed(node_tokens), cache, **positional)
            predicted = out.to(out_dtype)
            return predicted, self.score_draft(predicted)

        return expand

    def after_tree(self) -> None:
        """Only the entries from true inputs stay in the head's cache."""
        excess = self.cache.get_seq_length() - self.cached
        if excess > 0:
            self.cache.crop(-excess)


def _generate(backbone, head, condition, sampling, generator, settings: Eagle2DecodeConfig) -> GenerationResult:
    return generate_eagle2(backbone, head, condition, sampling, generator, settings)


# Lossless with either draws, as ssd_tree (decode/ssd_tree.py, above its METHOD).
METHOD = MethodSpec(
    generate=_generate,
    settings=Eagle2DecodeConfig,
    artefact="heads",
    artefact_kind="eagle",
)
