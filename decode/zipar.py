"""ZipAR (He et al., ICML 2025): training-free parallel decoding of the rows of an image. Not lossless.

Paper: "ZipAR: Parallel Auto-regressive Image Generation through Spatial
Locality"; code: github.com/ThisisBillhe/ZipAR (LlamaGen-ZipAR,
`autoregressive/models/generate_zipar.py`, `decode_n_tokens_zipar`; the window
`zipar_window_size = 8` in `gpt.py`).

Steps:

1. the first row token by token, as the baseline;
2. a row starts once the row above has `window` tokens; from then on every
   pass feeds, for each active row, its latest token at its own position and
   samples the row's next token from the output: one token per active row
   per pass;
3. a row's first token is predicted from a stand-in at the position that
   precedes it in raster order: the latest token of the row above placed at
   that row's last position (the reference code's auxiliary token; the real
   token overwrites it when that row ends), or, for families with an
   end-of-line token, that token itself;
4. a row's last token is fed once more in the pass after it is drawn, so that
   the rows below see it.

The cache is addressed by position (`ARImageBackbone.step_at`): each token
attends to every position before its own, and positions not decoded yet hold
zero keys and values, as in the reference code's static cache. With a window
of a whole row every row waits for the one above and ZipAR is the baseline
(same tokens under greedy decoding). The paper's adaptive window is not
implemented (the released code has a fixed one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backbones.base import ARImageBackbone, Condition
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.sampling import SamplingConfig, sample_tokens


@dataclass(frozen=True)
class ZipARDecodeConfig:
    """How far the row above must be before a row starts."""

    window: int = 8  # tokens of the row above before a row starts (LlamaGen's zipar_window_size; >= cols: AR)

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


@dataclass
class ZipARInput:
    """One token of a pass: its flat position, its value (B,) and the grid cell its output predicts, if any."""

    flat_position: int
    token: torch.Tensor
    predicts: tuple[int, int] | None


@torch.inference_mode()
def generate_zipar(
    backbone: ARImageBackbone,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    config: ZipARDecodeConfig = ZipARDecodeConfig(),
) -> GenerationResult:
    """Generate one image per condition with ZipAR's parallel rows (the module docstring's steps)."""
    rows, cols = backbone.geometry.rows, backbone.geometry.cols
    state, hidden = backbone.prefill(condition, sampling.guided)
    tokens = torch.empty(condition.batch_size, rows, cols, dtype=torch.long, device=hidden.device)
    for col in range(cols):  # step 1: the first row as the baseline decodes it
        if col:
            hidden = backbone.step(state, tokens[:, 0, col - 1 : col])
        tokens[:, 0, col] = sample_tokens(
            backbone.scores(state, hidden[:, -1:], sampling.cfg_scale), sampling, generator
        )[:, 0]
    passes = cols
    decoded = [cols] + [0] * (rows - 1)  # tokens drawn per row
    last_fed = [False] * rows  # whether a row's last token is in the cache
    started = min(2, rows)  # rows begun: the first is complete, so the second begins
    while min(decoded) < cols:
        inputs, ending = _pass_inputs(backbone, tokens, decoded, last_fed, started)
        positions = torch.tensor([i.flat_position for i in inputs], device=tokens.device)
        hidden = backbone.step_at(state, torch.stack([i.token for i in inputs], dim=1), positions)
        passes += 1
        predicting = [k for k, i in enumerate(inputs) if i.predicts is not None]
        scores = backbone.scores(state, hidden[:, predicting], sampling.cfg_scale)
        drawn = sample_tokens(scores, sampling, generator)  # (B, k)
        for j, k in enumerate(predicting):
            row, col = inputs[k].predicts
            tokens[:, row, col] = drawn[:, j]
            decoded[row] += 1
        for row in ending:
            last_fed[row] = True
        while started < rows and decoded[started - 1] >= min(config.window, cols):  # step 2: rows begin
            started += 1
    return GenerationResult(tokens, forward_passes=passes)


def _flat(backbone: ARImageBackbone, row: int, col: int) -> int:
    """The flat image position of grid cell (row, col) (end-of-line tokens counted)."""
    return backbone.geometry.flat_length(row * backbone.geometry.cols) + col


def _pass_inputs(
    backbone, tokens, decoded: list[int], last_fed: list[bool], started: int
) -> tuple[list[ZipARInput], list[int]]:
    """Steps 2-4: the tokens one pass feeds, one slot each, and the rows whose last token it feeds. A stand-in
    at a row's last slot once that row is complete is its last token: the two merge."""
    cols, end_of_line = backbone.geometry.cols, backbone.geometry.end_of_line
    by_slot: dict[int, ZipARInput] = {}
    ending = [row for row in range(started) if decoded[row] == cols and not last_fed[row]]
    for row in ending:  # step 4
        slot = _flat(backbone, row, cols - 1)
        by_slot[slot] = ZipARInput(slot, tokens[:, row, cols - 1], None)
    for row in range(started):
        done = decoded[row]
        if done == cols:
            continue
        if done:  # step 2: the latest token predicts the next
            slot = _flat(backbone, row, done - 1)
            by_slot[slot] = ZipARInput(slot, tokens[:, row, done - 1], (row, done))
        elif end_of_line:  # step 3: the end-of-line token after the row above
            slot = _flat(backbone, row - 1, cols - 1) + 1
            by_slot[slot] = ZipARInput(slot, torch.full_like(tokens[:, 0, 0], -1), (row, 0))
        else:  # step 3: the latest token of the row above, at that row's last position
            slot = _flat(backbone, row - 1, cols - 1)
            latest = tokens[:, row - 1, decoded[row - 1] - 1]
            by_slot[slot] = ZipARInput(slot, latest, (row, 0))
    return [by_slot[slot] for slot in sorted(by_slot)], ending


def _generate(backbone, _artefact, condition, sampling, generator, settings: ZipARDecodeConfig) -> GenerationResult:
    return generate_zipar(backbone, condition, sampling, generator, settings)


METHOD = MethodSpec(generate=_generate, settings=ZipARDecodeConfig, lossless=lambda settings: False)
