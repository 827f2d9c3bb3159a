"""Every decoding method still produces the tokens and pass counts pinned in tests/data/decode_pins.json."""

import json
import math

from decode_pins import PINS_FILE, compute_pins

FLOAT_TOLERANCE = 1e-4  # continuous tokens' sums and first values (decode_pins.py's module doc)


def same_record(pinned: dict, fresh: dict) -> bool:
    """Equal counts and hashes; continuous tokens' floats equal to FLOAT_TOLERANCE."""
    if set(pinned) != set(fresh):
        return False
    for key, value in pinned.items():
        if isinstance(value, float):
            if not math.isclose(value, fresh[key], rel_tol=0, abs_tol=FLOAT_TOLERANCE):
                return False
        elif isinstance(value, list):
            if len(value) != len(fresh[key]) or not all(
                math.isclose(a, b, rel_tol=0, abs_tol=FLOAT_TOLERANCE) for a, b in zip(value, fresh[key])
            ):
                return False
        elif value != fresh[key]:
            return False
    return True


def test_every_method_reproduces_its_pinned_tokens_and_pass_counts():
    pinned = json.loads(PINS_FILE.read_text())
    fresh = compute_pins()
    assert set(fresh) == set(pinned), "cases were added or removed: regenerate with python tests/decode_pins.py --write"
    changed = [
        f"{case}/{run}: {pinned[case][run]} -> {fresh[case][run]}"
        for case in pinned
        for run in pinned[case]
        if not same_record(pinned[case][run], fresh[case][run])
    ]
    assert not changed, "decoding changed behaviour:\n" + "\n".join(changed)


def test_the_comparison_catches_a_changed_token_or_count():
    record = {"tokens_sum": 1.5, "tokens_first": [0.25, -0.5], "forward_passes": 7, "tokens_sha1": "ab"}
    assert same_record(record, {**record, "tokens_sum": 1.5 + FLOAT_TOLERANCE / 2})
    assert not same_record(record, {**record, "tokens_sum": 1.5 + 2 * FLOAT_TOLERANCE})
    assert not same_record(record, {**record, "tokens_first": [0.25, -0.49]})
    assert not same_record(record, {**record, "forward_passes": 8})
    assert not same_record(record, {**record, "tokens_sha1": "ac"})
