"""Leaks between the images of a ragged batch, planted by the tests of every ragged generator: each must change an
image's sampled tokens from what it gets alone (tests/test_ssd_ragged.py, tests/test_sjd_ragged.py)."""

from backbones.base import ARImageBackbone


def feed_from_the_next_image(monkeypatch):
    """Every image's run is fed at the next image's frontier."""
    original = ARImageBackbone.step_ragged

    def leaky(self, state, tokens, starts):
        return original(self, state, tokens, starts.roll(1))

    monkeypatch.setattr(ARImageBackbone, "step_ragged", leaky)


def keep_the_previous_prompt(monkeypatch):
    """A refilled slot keeps the previous image's prompt (its class) in the cache."""
    monkeypatch.setattr(ARImageBackbone, "replace_images", lambda self, state, images, fresh, fresh_images=None: None)


PLANTED_LEAKS = [feed_from_the_next_image, keep_the_previous_prompt]
