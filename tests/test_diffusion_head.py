"""MAR's diffusion head and the embedded continuous backbone (backbones/diffusion_head.py, digits_continuous.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_continuous

from backbones.base import Condition
from backbones.diffusion_head import DiffusionHead, DiffusionHeadConfig, respaced_steps
from backbones.digits_continuous import ContinuousDigitsConfig


def reference_sample(head: DiffusionHead, z, noise, cfg_scale, temperature, guided):
    """The sampler written the slow way: the network's forward and the process's reverse step by step."""
    process, x = head.sampling_process, noise[:, 0]
    for k, step in enumerate(range(len(process) - 1, -1, -1), start=1):
        t = process.timesteps[step].expand(z.shape[0])
        if guided:
            eps, frac = head.net(torch.cat([x, x]), t, z)
            cond, uncond = eps.chunk(2)
            eps, frac = uncond + cfg_scale * (cond - uncond), frac.chunk(2)[0]
        else:
            eps, frac = head.net(x, t, z)
        mean, log_var = process.reverse(x, step, eps, frac, clip=head.config.clip_denoised)
        std = temperature * (0.5 * log_var).exp()
        if step == 0:
            return (mean + std * noise[:, k] if head.config.final_step_noise else mean), mean, std
        x = mean + std * noise[:, k]


@pytest.mark.parametrize("guided", [False, True])
@pytest.mark.parametrize("final_step_noise,clip", [(False, False), (True, True)])
def test_fast_sampler_is_the_reference_arithmetic(guided, final_step_noise, clip):
    torch.manual_seed(0)
    config = DiffusionHeadConfig(token_dim=4, condition_dim=16, width=32, depth=2, sampling_steps=10,
                                 final_step_noise=final_step_noise, clip_denoised=clip)  # fmt: skip
    head = DiffusionHead(config)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.1)
    head = head.double()  # float64: the first reverse step divides by sqrt(alpha_bar_T) ~ 5e-5, amplifying rounding
    z = torch.randn(6 if guided else 3, 16, dtype=torch.float64)
    noise = torch.randn(3, head.noise_steps, 4, dtype=torch.float64)
    fast = head.sample(z, noise, cfg_scale=2.5, temperature=0.9, guided=guided)
    tokens, mean, std = reference_sample(head, z, noise, 2.5, 0.9, guided)
    torch.testing.assert_close(fast.tokens, tokens, rtol=0, atol=1e-9)
    torch.testing.assert_close(fast.final_mean, mean, rtol=0, atol=1e-9)
    torch.testing.assert_close(fast.final_std, std, rtol=0, atol=1e-12)
    assert head.noise_steps == 10 + int(final_step_noise)


def test_respacing_keeps_mars_steps_evenly():
    steps = respaced_steps(1000, 100)
    assert len(steps) == 100 and steps[0] == 0 and steps[-1] == 999 and steps[1] == 10  # MAR's 100 of 1000
    head = DiffusionHead(DiffusionHeadConfig(token_dim=2, condition_dim=4, sampling_steps=25))
    alphas = head.sampling_process.alphas_cumprod
    assert bool((alphas[1:] < alphas[:-1]).all()) and float(alphas[-1]) < 1e-6  # ends at (almost) pure noise


def test_head_trains_to_sample_its_data():
    """The loss and the sampler agree: a head trained on a 2-D Gaussian per condition samples that Gaussian."""
    torch.manual_seed(0)
    config = DiffusionHeadConfig(token_dim=2, condition_dim=2, width=64, depth=2, sampling_steps=20, clip_denoised=True)
    head = DiffusionHead(config)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    centres = torch.tensor([[0.5, -0.5], [-0.5, 0.3]])
    for _ in range(600):
        which = torch.randint(0, 2, (256,))
        z = torch.nn.functional.one_hot(which, 2).float()
        data = centres[which] + 0.1 * torch.randn(256, 2)
        loss = head.loss(z, data).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        z = torch.nn.functional.one_hot(torch.ones(2000, dtype=torch.long), 2).float()
        samples = head.sample(z, torch.randn(2000, head.noise_steps, 2)).tokens
    torch.testing.assert_close(samples.mean(0), centres[1], atol=0.03, rtol=0)
    assert 0.06 < float(samples.std(0).mean()) < 0.15


def test_teacher_forced_states_equal_cached_steps_and_rollback():
    backbone = tiny_continuous()
    tokens = torch.randn(2, 16, 4)
    class_ids = torch.tensor([3, 7])
    forced = backbone.teacher_forced_hidden_states(tokens, class_ids)
    state, first = backbone.prefill(Condition(class_ids=class_ids), guided=False)
    stepped = torch.cat([first, backbone.step(state, tokens[:, :-1])], dim=1)
    torch.testing.assert_close(stepped, forced, atol=1e-5, rtol=1e-5)
    backbone.rollback(state, 5)
    again = backbone.step(state, tokens[:, 5:9])
    torch.testing.assert_close(again, forced[:, 6:10], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="past the image"):
        backbone.step(state, torch.zeros(2, 16, 4))


def test_patches_round_trip_and_guidance_at_scale_one_is_conditional():
    backbone = tiny_continuous()
    images = torch.rand(3, 1, 8, 8)
    tokens = backbone.pixels_to_tokens(images)
    assert tokens.shape == (3, 4, 4, 4) and float(tokens.min()) >= -1 and float(tokens.max()) <= 1
    torch.testing.assert_close(backbone.tokens_to_pixels(tokens), images)
    condition = Condition(class_ids=torch.tensor([1, 2]))
    noise = backbone.draw_noise(2, 1, torch.Generator().manual_seed(0))
    guided_state, guided_hidden = backbone.prefill(condition, guided=True)
    plain_state, plain_hidden = backbone.prefill(condition, guided=False)
    guided = backbone.sample_tokens(guided_state, guided_hidden, noise, cfg_scale=1.0, temperature=1.0)
    plain = backbone.sample_tokens(plain_state, plain_hidden, noise, cfg_scale=1.0, temperature=1.0)
    torch.testing.assert_close(guided.tokens, plain.tokens, atol=1e-5, rtol=0)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="multiple of patch_size"):
        ContinuousDigitsConfig(image_size=9, patch_size=2)
    with pytest.raises(ValueError, match="sampling_steps"):
        DiffusionHeadConfig(token_dim=2, condition_dim=2, sampling_steps=2000)
    head = DiffusionHead(DiffusionHeadConfig(token_dim=2, condition_dim=2, sampling_steps=5))
    with pytest.raises(ValueError, match="noise has 3 steps"):
        head.sample(torch.zeros(1, 2), torch.zeros(1, 3, 2))
