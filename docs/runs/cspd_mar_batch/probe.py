"""Target passes of exact CSpD on a tiny random MAR (float64), drafter = target nudged by 1e-9, by batch size.

Run from the repository root: python docs/runs/cspd_mar_batch/probe.py (figures in results.txt beside it).
"""

import sys

import torch

sys.path.insert(0, "tests")
from test_decode_cspd_mar import draws, near_copy, tiny  # noqa: E402

from decode.cspd_mar import CSpDMARConfig, generate_cspd_mar  # noqa: E402

target = tiny()
drafter = near_copy(target, 1e-9)
for num_iter in (16, 8):
    for batch in (1, 16, 64):
        passes, rates = [], []
        for seed in range(4):
            orders, noise = draws(batch, target, seed=20 + seed)
            result = generate_cspd_mar(
                target, drafter, torch.full((batch,), 3), CSpDMARConfig(gamma=4), num_iter, 3.0,
                orders=orders, noise=noise, generator=torch.Generator().manual_seed(seed),
            )  # fmt: skip
            passes.append(result.forward_passes)
            rates.append(result.accepted_tokens / max(result.drafted_tokens, 1))
        print(
            f"num_iter {num_iter} batch {batch:3d}: target passes {sum(passes) / len(passes):.2f} (AR {num_iter}), "
            f"acceptance {sum(rates) / len(rates):.3f}"
        )
