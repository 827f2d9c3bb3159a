"""Run a ragged call twice on the same inputs, with attention over each row group's own keys
(backbones/ragged_attention.py) and as one masked call, in alternating order, for the paired scripts beside this
file. Both write the same cache entries, so the run goes on as it would."""

import contextlib
import time

import backbones.ragged_attention as ragged_attention

GROUPED = ragged_attention.own_keys


def one_call(row_ends, queries):
    """Stands in for `own_keys`: no grouping."""
    return contextlib.nullcontext()


def both_ways(function, totals: dict):
    """`function` wrapped: each call runs both ways, adding their seconds to ``totals["own keys"]`` and
    ``totals["one call"]``, counting ``totals["calls"]`` and the largest difference of their outputs; returns the
    grouped output."""

    def wrapped(*args):
        order = ("own keys", "one call") if totals.get("calls", 0) % 2 else ("one call", "own keys")
        outputs = {}
        for name in order:
            ragged_attention.own_keys = GROUPED if name == "own keys" else one_call
            began = time.perf_counter()
            outputs[name] = function(*args)
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - began
        ragged_attention.own_keys = GROUPED
        totals["calls"] = totals.get("calls", 0) + 1
        difference = (outputs["own keys"] - outputs["one call"]).abs().max().item()
        totals["max_difference"] = max(totals.get("max_difference", 0.0), difference)
        return outputs["own keys"]

    return wrapped


def summary(totals: dict) -> dict:
    """What the paired scripts print and save of `totals`."""
    return dict(
        calls=totals["calls"],
        one_call_s=totals["one call"],
        own_keys_s=totals["own keys"],
        saved=1 - totals["own keys"] / totals["one call"],
        max_output_difference=totals["max_difference"],
    )
