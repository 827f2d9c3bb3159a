"""Per-call costs behind ssd_ragged's batch-16 profile: the SSD heads' row work (vertical head, grid head's
prepare_above) for 1, 3 and 16 images (both CFG twins), and scaled_dot_product_attention at a ragged pass's shapes
(32 rows, 3 heads of 64) with and without a mask.

    python docs/runs/batching/2026-12-07_profile_b16/kernel_costs.py   # from the repository root, machine idle
"""

import time

import torch
import torch.nn.functional as F

from backbones.digits import DigitsBackbone
from heads.export import load_heads

torch.set_num_threads(2)


def milliseconds(function, *arguments, repeats=200, **keywords):
    for _ in range(10):
        function(*arguments, **keywords)
    began = time.perf_counter()
    for _ in range(repeats):
        function(*arguments, **keywords)
    return (time.perf_counter() - began) / repeats * 1e3


backbone = DigitsBackbone.from_pretrained("checkpoints/digits-backbone").eval()
heads = load_heads("checkpoints/ssd_digits", backbone)
with torch.inference_mode():
    for rows in (2, 6, 32):
        hidden, embedded = torch.randn(rows, 24, 192), torch.randn(rows, 24, 192)
        print(
            f"{rows} rows: vertical head {milliseconds(heads.vertical, hidden, embedded):.3f} ms, "
            f"prepare_above {milliseconds(heads.grid.prepare_above, hidden, embedded):.3f} ms"
        )
    for queries, keys in ((1, 600), (9, 300), (9, 600), (17, 600), (25, 600)):
        q, k, v = torch.randn(32, 3, queries, 64), torch.randn(32, 3, keys, 64), torch.randn(32, 3, keys, 64)
        mask = torch.rand(32, 1, queries, keys) > 0.3
        plain = milliseconds(F.scaled_dot_product_attention, q, k, v)
        masked = milliseconds(F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
        print(f"SDPA {queries} queries over {keys} keys: {plain:.3f} ms, with a boolean mask {masked:.3f} ms")
