"""Every decoding method still produces the tokens and pass counts pinned in tests/data/decode_pins.json."""

import json

from decode_pins import PINS_FILE, compute_pins


def test_every_method_reproduces_its_pinned_tokens_and_pass_counts():
    pinned = json.loads(PINS_FILE.read_text())
    fresh = compute_pins()
    assert set(fresh) == set(pinned), "cases were added or removed: regenerate with python tests/decode_pins.py --write"
    changed = [
        f"{case}/{run}: {pinned[case][run]} -> {fresh[case][run]}"
        for case in pinned
        for run in pinned[case]
        if fresh[case][run] != pinned[case][run]
    ]
    assert not changed, "decoding changed behaviour:\n" + "\n".join(changed)
