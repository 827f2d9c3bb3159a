"""`decode.compile` compiles the backbone's passes (`ARImageBackbone.compile_passes`): every family names the
module its passes really run through, the CLI compiles once before any method runs, and compiled passes
change no greedy token."""

import json

import pytest
import torch
from conftest import compose_config, random_ssd_heads
from tiny_adapters import ADAPTERS

from backbones.base import Condition
from decode import SamplingConfig, SSDDecodeConfig, generate_ar, generate_ssd


class _CountingCompile:
    """Stands in for torch.compile: returns the function wrapped in a call counter (no compiler runs)."""

    def __init__(self):
        self.compiled, self.calls = 0, 0

    def __call__(self, function, *args, **kwargs):
        self.compiled += 1

        def counted(*call_args, **call_kwargs):
            self.calls += 1
            return function(*call_args, **call_kwargs)

        return counted


@pytest.mark.filterwarnings("ignore:.*no codebook latents")
@pytest.mark.parametrize("family", ["digits", *sorted(ADAPTERS)])
def test_every_pass_runs_through_what_compile_passes_compiles(family, tiny_backbone, monkeypatch):
    if family == "digits":
        backbone, condition = tiny_backbone, Condition(class_ids=torch.tensor([1, 8]))
    else:
        make_backbone, make_condition, _ = ADAPTERS[family]
        backbone, condition = make_backbone(), make_condition()
    fake = _CountingCompile()
    monkeypatch.setattr(torch, "compile", fake)
    backbone.compile_passes()
    assert fake.compiled == 1
    state, _ = backbone.prefill(condition, guided=True)
    backbone.step(state, torch.zeros(2, 1, dtype=torch.long))
    backbone.step(state, torch.zeros(2, 3, dtype=torch.long))
    ragged_state, _ = backbone.prefill(condition, guided=True)
    backbone.step_ragged(ragged_state, torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 2]))
    assert fake.calls == 5  # two prefills (run under the eager stance), two steps, one ragged pass


def test_a_continuous_backbones_passes_run_through_what_compile_passes_compiles(monkeypatch):
    from backbones.digits_continuous import random_continuous_digits_backbone

    backbone = random_continuous_digits_backbone(seed=0)
    fake = _CountingCompile()
    monkeypatch.setattr(torch, "compile", fake)
    backbone.compile_passes()
    state, _ = backbone.prefill(Condition(class_ids=torch.tensor([1, 8])), guided=True)
    backbone.step(state, torch.zeros(2, 3, backbone.token_dim))
    assert fake.compiled == 1 and fake.calls == 2  # the prefill (under the eager stance) and the step


def test_decode_compile_compiles_the_backbone_once_and_says_so(tmp_path, classifier_cache, monkeypatch, capsys):
    fake = _CountingCompile()
    monkeypatch.setattr(torch, "compile", fake)
    out = tmp_path / "out"
    from decode.cli import run_decode

    run_decode(
        compose_config(
            [
                "backbone=digits_tiny",
                "decode.num_images=2",
                "decode.batch_size=2",
                "decode.compile=true",
                f"decode.out={out}",
                f"paths.checkpoints_dir={classifier_cache}",
            ],
            tmp_path,
        )
    )
    assert fake.compiled == 1 and fake.calls > 64  # warm-up and the timed batch, one call per pass
    assert json.loads((out / "metrics.json").read_text())["compiled"] is True
    assert "compiling the backbone's passes" in capsys.readouterr().out


def test_a_backbone_without_compiled_passes_runs_eager_and_says_so(capsys):
    from backbones.mar import random_mar_backbone
    from decode.cli import compile_backbone

    assert compile_backbone(random_mar_backbone(seed=0)) is False
    assert "MARBackbone's passes cannot be compiled; every method runs eager" in capsys.readouterr().out


@pytest.mark.slow
def test_compiled_passes_change_no_greedy_token(tiny_backbone):
    """The real compiler (about a minute on 2 cores): greedy AR and greedy exact SSD with compiled passes give
    eager greedy AR's tokens, and a compiled pass's states are the eager pass's up to float rounding."""
    condition = Condition(class_ids=torch.tensor([0, 3, 7, 9]))
    sampling = SamplingConfig(greedy=True, cfg_scale=3.0)
    eager = generate_ar(tiny_backbone, condition, sampling)
    state, _ = tiny_backbone.prefill(condition, guided=True)
    eager_states = tiny_backbone.step(state, eager.tokens.flatten(1)[:, :12])
    tiny_backbone.compile_passes()
    state, _ = tiny_backbone.prefill(condition, guided=True)
    compiled_states = tiny_backbone.step(state, eager.tokens.flatten(1)[:, :12])
    torch.testing.assert_close(compiled_states, eager_states, rtol=1e-4, atol=1e-5)
    assert torch.equal(generate_ar(tiny_backbone, condition, sampling).tokens, eager.tokens)
    heads = random_ssd_heads(tiny_backbone.hidden_size, grid=True)
    speculative = generate_ssd(tiny_backbone, heads, condition, sampling, config=SSDDecodeConfig(mode="exact"))
    assert torch.equal(speculative.tokens, eager.tokens)


def test_the_main_jobs_evaluation_compiles_and_a_plain_decode_run_does_not(tmp_path, monkeypatch):
    """Batch 1 (the main job's evaluation): compiled passes are the baseline's fastest form on a CPU; at batch 16
    they are not (ragged passes run 2-3x slower compiled), so `python -m decode` stays eager unless asked."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    import decode.cli
    from common.paths import PROJECT_ROOT
    from train.pipeline import evaluate_export

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config")
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    assert cfg.decode.compile is False
    seen = {}
    monkeypatch.setattr(decode.cli, "run_decode", lambda eval_cfg: seen.update(compile=eval_cfg.decode.compile))
    evaluate_export(cfg, tmp_path / "export")
    assert seen == {"compile": True} and cfg.train.evaluate.batch_size == 1
