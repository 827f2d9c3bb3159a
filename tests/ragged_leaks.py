"""Leaks between the images of a ragged batch, planted by the tests of every ragged generator: each must change an
image's sampled tokens from what it gets alone (tests/test_ssd_ragged.py, tests/test_sjd_ragged.py,
tests/test_eagle_ragged.py); and the batch size each ragged pass sees, for their drain tests."""

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


def drain_into_other_images_rows(monkeypatch):
    """When the batch drains its finished slots, the kept images get each other's cache rows."""
    original = ARImageBackbone.keep_images

    def shuffled(self, state, images):
        return original(self, state, images.roll(1))

    monkeypatch.setattr(ARImageBackbone, "keep_images", shuffled)


PLANTED_LEAKS = [feed_from_the_next_image, keep_the_previous_prompt, drain_into_other_images_rows]


def record_ragged_batch_sizes(monkeypatch) -> list[int]:
    """From now on, the batch size of every ragged pass is appended to the list returned."""
    sizes: list[int] = []
    original = ARImageBackbone.step_ragged

    def recording(self, state, tokens, starts):
        sizes.append(state.batch_size)
        return original(self, state, tokens, starts)

    monkeypatch.setattr(ARImageBackbone, "step_ragged", recording)
    return sizes
