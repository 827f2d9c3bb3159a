"""The benchmark's split of a method's time: inside the backbone's passes, and the rest."""

import torch
from mock_backbone import MockBackbone

import decode.backbone_clock as backbone_clock
from backbones.base import Condition


class FakeClock:
    """perf_counter for the clock under test: time moves only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_clock_counts_only_the_backbone_passes_and_restores_the_methods(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(backbone_clock, "time", fake)
    backbone = MockBackbone()
    real_step = type(backbone).step

    def slow_step(self, state, tokens):  # every pass takes 0.25 s of fake time
        fake.now += 0.25
        return real_step(self, state, tokens)

    monkeypatch.setattr(type(backbone), "step", slow_step)
    with backbone_clock.clock_backbone_passes(backbone) as clock:
        state, _ = backbone.prefill(Condition(class_ids=torch.tensor([0])), guided=False)
        for _ in range(3):
            backbone.step(state, torch.zeros(1, 1, dtype=torch.long))
            fake.now += 1.0  # drafting and verification: not the backbone's time
    assert clock.seconds == 0.75
    assert "step" not in vars(backbone) and "prefill" not in vars(backbone)


def test_clock_puts_back_a_method_the_instance_holds_itself(tiny_backbone, monkeypatch):
    """Compiled passes keep an instance's prefills eager (`prefills_stay_eager`); timing a batch must not drop that
    version, or every later batch compiles its prefills inside the timed turns."""
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: function)  # no compiler: the wiring only
    tiny_backbone.compile_passes()
    own_prefill = vars(tiny_backbone)["prefill"]
    with backbone_clock.clock_backbone_passes(tiny_backbone):
        tiny_backbone.prefill(Condition(class_ids=torch.tensor([0])), guided=False)
    assert vars(tiny_backbone)["prefill"] is own_prefill and "step" not in vars(tiny_backbone)


class FakeCudaEvent:
    """torch.cuda.Event for the CUDA branch without a GPU: records the fake time, reports milliseconds."""

    def __init__(self, clock, enable_timing):
        assert enable_timing
        self.clock, self.at = clock, None

    def record(self):
        self.at = self.clock.now

    def elapsed_time(self, end):
        return (end.at - self.at) * 1000


def test_cuda_clock_sums_event_pairs_and_synchronises_once(monkeypatch):
    """On CUDA the clock records an event pair around each pass and reads them all at the end."""
    fake, synchronised = FakeClock(), []
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: FakeCudaEvent(fake, enable_timing))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synchronised.append(True))
    clock = backbone_clock.BackboneClock(torch.device("cuda"))

    def gpu_pass():
        fake.now += 0.5

    timed = clock.time(gpu_pass)
    for _ in range(4):
        timed()
        fake.now += 2.0  # the host's work between passes is not counted
    assert not synchronised  # no synchronisation while passes are being issued
    assert clock.seconds == 2.0 and synchronised == [True]
