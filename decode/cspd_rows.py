"""CSpD with row drafts from latent heads: a whole row of continuous tokens drafted at once (beyond the paper).

CSpD's drafter (decode/cspd.py) samples its drafts one after another, each through
its own diffusion head; on a small model that sampling, not the transformer,
is most of a draft's cost. SSD's observation (Xiang et al., 2026) carries
over to continuous tokens: the backbone's state one row below a token is
predictable from the state and the token above it. Here a vertical latent head
(`heads.cspd.ContinuousRowHeads`, trained by `python -m train
+experiment=cspd_rows_digits`) predicts, from the committed row above, the
backbone's states of the positions still to decode in the current row; the
backbone's own diffusion head samples all of them in one batched run on the
backbone's own trajectory noise, and CSpD's verification (`speculate`: one pass,
one batched run, the final-step Gaussians' ratio, residual, bonus token)
decides. Steps:

1. The first row comes from the backbone (nothing above it to draft from), as
   do at least ``prefill_fraction`` of the tokens.
2. Each round drafts the rest of the current row: states from the head on the
   row above, tokens from the backbone's diffusion head on those states.
3. Verify as CSpD (module doc of decode/cspd.py, steps 4 and 5).

Exact with ``tau = 1``: a draft is a sample of a Gaussian that the test
compares with the backbone's own, whatever state it was conditioned on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backbones.base import Condition
from backbones.continuous import ContinuousARBackbone
from decode.cspd import DraftRound, Speculation, check_last_step_drawn, check_verification, speculate
from decode.method import MethodSpec
from decode.result import GenerationResult
from decode.sampling import SamplingConfig


@dataclass(frozen=True)
class CSpDRowsConfig:
    """Row drafting's settings; the acceptance test is CSpD's."""

    prefill_fraction: float = 0.05  # at least the first row either way
    tau: float = 1.0  # 1: exact (see CSpDConfig)

    def __post_init__(self):
        check_verification(self.prefill_fraction, self.tau, "cspd_rows")


@torch.inference_mode()
def generate_cspd_rows(
    backbone: ContinuousARBackbone,
    heads,
    condition: Condition,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    settings: CSpDRowsConfig,
    noise: torch.Tensor | None = None,
) -> GenerationResult:
    """Generate one image per condition, each row after the first drafted by `heads` and verified (module doc)."""
    check_last_step_drawn(settings.tau == 1.0, "cspd_rows", backbone)
    cols = backbone.geometry.cols

    def draft(run: Speculation, pending: int) -> DraftRound:
        first = pending + 1
        row, column = divmod(first, cols)
        above = slice((row - 1) * cols, row * cols)
        tokens_above = run.tokens[:, above]
        if run.state.guided:  # each twin's states with the same tokens
            tokens_above = tokens_above.repeat(2, 1, 1)
        predicted = heads(run.states[:, above], backbone.embed_tokens(tokens_above))  # (rows, cols, H)
        positions = slice(first, (row + 1) * cols)
        drawn = backbone.sample_tokens(
            run.state, predicted[:, column:], run.noise[:, positions], run.sampling.cfg_scale, run.sampling.temperature
        )
        return DraftRound.of([drawn])

    return speculate(
        backbone, condition, sampling, generator, (draft, lambda last: None), noise,
        prefill_fraction=settings.prefill_fraction, tau=settings.tau, min_prefill=cols,
    )  # fmt: skip


def _generate(backbone, heads, condition, sampling, generator, settings: CSpDRowsConfig) -> GenerationResult:
    return generate_cspd_rows(backbone, heads, condition, sampling, generator, settings)


METHOD = MethodSpec(
    generate=_generate,
    settings=CSpDRowsConfig,
    artefact="heads",
    artefact_kind="cspd_rows",
    lossless=lambda s: s.tau == 1.0,
    token_kind="continuous",
)
