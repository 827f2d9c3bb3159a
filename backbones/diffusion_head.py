"""MAR's per-token diffusion head: how a continuous-token AR model samples each token.

A continuous-token generator (MAR, xAR, Harmon, the embedded continuous digits
model) has no token distribution to read off: its transformer produces a
conditioning vector ``z`` per position and a small denoising network samples the
token given ``z`` (Li et al., "Autoregressive Image Generation without Vector
Quantization", NeurIPS 2024; LTH14/mar ``models/diffloss.py`` and its
``diffusion/`` package, itself OpenAI's guided-diffusion). What this file keeps
of it:

- the network: an MLP of residual blocks whose LayerNorm is modulated (AdaLN:
  shift, scale, gate) by ``timestep embedding + Linear(z)``, a final AdaLN
  layer, output ``2 * token_dim`` (the noise and the interpolation of its
  variance: learned-range sigma);
- the process: cosine noise schedule over 1,000 training steps; training loss
  MSE on the noise plus the variational bound for the variance (the bound's
  mean gradient stopped);
- sampling: the 1,000 steps respaced to `sampling_steps` evenly spaced ones;
  classifier-free guidance mixes the twins' noise predictions
  ``eps_u + s * (eps_c - eps_u)`` (each twin keeps its own variance); the
  temperature multiplies the noise added at every step.

What is new here is that every random draw is an argument: `sample` takes the
initial noise and each step's noise, so two models can be run on the same
trajectory noise (CSpD's trajectory alignment) and a test can replay a draw.
`sample` also returns the Gaussian of the final reverse step given the rest of
the trajectory, the distribution CSpD's acceptance test reads. In the reference
that step adds no noise (the token is its mean); `final_step_noise` draws the
token from it instead (std ~0.006 at temperature 1, invisible in pixels), which
makes a token given its trajectory exactly Gaussian and CSpD exactly lossless.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn


@dataclass(frozen=True)
class DiffusionHeadConfig:
    """Shape and process of a diffusion head; stored with the model that owns it."""

    token_dim: int  # channels of one continuous token
    condition_dim: int  # size of the transformer's conditioning vector z
    width: int = 256  # MLP width (MAR-B: 1024; the embedded model is ~100x smaller)
    depth: int = 3  # residual AdaLN blocks (MAR: 3 for B/L, 3+ for H)
    training_steps: int = 1000  # MAR's
    sampling_steps: int = 50  # MAR samples with 100; 50 keeps the embedded model's CPU cost down
    # MAR's last reverse step adds no noise (the token is its mean). With noise there, a token given the
    # rest of its trajectory is exactly Gaussian, which is what makes CSpD's ratio test lossless.
    final_step_noise: bool = False
    # Clip each step's estimate of x_0 to [-1, 1] (guided-diffusion's clip_denoised, for data in that range, as
    # pixels). MAR's latents are unbounded and it does not clip. The first reverse step divides the network's error
    # by sqrt(alpha_bar_T) ~ 5e-5: unclipped, a head not trained to ~1e-4 there throws samples to |x| ~ 100.
    clip_denoised: bool = False
    # Sinusoidal frequencies of the timestep embedding fed to the time MLP (None: `width`). MAR's released heads
    # take 256 (DiT's TimestepEmbedder) at every width.
    time_frequencies: int | None = None

    def __post_init__(self):
        if self.time_frequencies is not None and (self.time_frequencies < 2 or self.time_frequencies % 2):
            raise ValueError(f"diffusion head time_frequencies must be even and >= 2, got {self.time_frequencies}")
        for key in ("token_dim", "condition_dim", "width", "depth", "training_steps", "sampling_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"diffusion head {key} must be >= 1, got {getattr(self, key)}")
        if self.sampling_steps < 2:
            raise ValueError(
                f"diffusion head sampling_steps must be >= 2 (one random step at least), got {self.sampling_steps}"
            )
        if self.sampling_steps > self.training_steps:
            raise ValueError(
                f"diffusion head sampling_steps ({self.sampling_steps}) cannot exceed training_steps "
                f"({self.training_steps})"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def cosine_alphas_cumprod(steps: int, max_beta: float = 0.999) -> torch.Tensor:
    """The cosine schedule's cumulative alphas (steps,) in float64 (Nichol & Dhariwal; MAR's `cosine`)."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = [min(1 - alpha_bar((i + 1) / steps) / alpha_bar(i / steps), max_beta) for i in range(steps)]
    return torch.cumprod(1 - torch.tensor(betas, dtype=torch.float64), 0)


def respaced_steps(training_steps: int, sampling_steps: int) -> list[int]:
    """`sampling_steps` training timesteps spread evenly over [0, training_steps) (guided-diffusion's rule)."""
    if sampling_steps == 1:
        return [0]
    stride = (training_steps - 1) / (sampling_steps - 1)
    return sorted({round(i * stride) for i in range(sampling_steps)})


class NoiseProcess(nn.Module):
    """The Gaussian diffusion of one schedule: its coefficients as float64 buffers, indexed by step."""

    def __init__(self, alphas_cumprod: torch.Tensor, timesteps: list[int]):
        super().__init__()
        alphas_cumprod = alphas_cumprod.double()
        previous = torch.cat([alphas_cumprod.new_ones(1), alphas_cumprod[:-1]])
        betas = 1 - alphas_cumprod / previous
        posterior_variance = betas * (1 - previous) / (1 - alphas_cumprod)
        buffers = {
            "timesteps": torch.tensor(timesteps, dtype=torch.long),  # the training step each step stands for
            "alphas_cumprod": alphas_cumprod,
            "log_betas": betas.log(),
            # The first posterior variance is 0; guided-diffusion clips its log to the second's.
            "posterior_log_variance": torch.cat([posterior_variance[1:2], posterior_variance[1:]]).log(),
            "posterior_mean_x0": betas * previous.sqrt() / (1 - alphas_cumprod),
            "posterior_mean_xt": (1 - previous) * (1 - betas).sqrt() / (1 - alphas_cumprod),
        }
        for name, value in buffers.items():
            self.register_buffer(name, value, persistent=False)

    @classmethod
    def respaced(cls, training_steps: int, sampling_steps: int) -> NoiseProcess:
        """The training schedule kept at `sampling_steps` of its steps (betas recomputed between them)."""
        full = cosine_alphas_cumprod(training_steps)
        kept = respaced_steps(training_steps, sampling_steps)
        return cls(full[kept], kept)

    def __len__(self) -> int:
        return len(self.timesteps)

    def coefficient(self, name: str, step: torch.Tensor | int, like: torch.Tensor) -> torch.Tensor:
        """Buffer `name` at `step` (scalar or (N,)), shaped to broadcast over `like` (N, D) in its dtype."""
        value = getattr(self, name)[step]
        return value.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))

    def noised(self, x0: torch.Tensor, step: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """q(x_t | x_0): ``sqrt(a_t) x_0 + sqrt(1 - a_t) noise``."""
        a = self.coefficient("alphas_cumprod", step, x0)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def posterior(self, x0: torch.Tensor, xt: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
        """q(x_{t-1} | x_t, x_0): (mean, log variance)."""
        mean = (
            self.coefficient("posterior_mean_x0", step, xt) * x0 + self.coefficient("posterior_mean_xt", step, xt) * xt
        )
        return mean, self.coefficient("posterior_log_variance", step, xt).expand_as(xt)

    def reverse(self, xt: torch.Tensor, step, eps: torch.Tensor, variance_frac: torch.Tensor, clip: bool = False):
        """p(x_{t-1} | x_t) from the network's output: (mean, log variance).

        Learned-range variance: ``log var = f * log beta_t + (1 - f) * log posterior variance``, f = (v + 1) / 2.
        `clip` clamps the implied x_0 to [-1, 1] first.
        """
        a = self.coefficient("alphas_cumprod", step, xt)
        x0 = (xt - (1 - a).sqrt() * eps) / a.sqrt()
        if clip:
            x0 = x0.clamp(-1, 1)
        mean, min_log = self.posterior(x0, xt, step)
        max_log = self.coefficient("log_betas", step, xt)
        frac = (variance_frac + 1) / 2
        return mean, frac * max_log + (1 - frac) * min_log


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of (N,) timesteps -> (N, dim), cos half first (guided-diffusion's layout)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return nn.functional.pad(embedding, (0, dim % 2))


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class _AdaLNBlock(nn.Module):
    """LayerNorm modulated by the condition, MLP, gated residual."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(_modulate(self.norm(x), shift, scale))


class DenoisingMLP(nn.Module):
    """MAR's SimpleMLPAdaLN: (x_t, t, z) -> (noise, variance interpolation), each (N, token_dim)."""

    def __init__(self, config: DiffusionHeadConfig):
        super().__init__()
        width = config.width
        self.width, self.time_frequencies = width, config.time_frequencies or width
        self.time_embed = nn.Sequential(nn.Linear(self.time_frequencies, width), nn.SiLU(), nn.Linear(width, width))
        self.condition_embed = nn.Linear(config.condition_dim, width)
        self.input_proj = nn.Linear(config.token_dim, width)
        self.blocks = nn.ModuleList(_AdaLNBlock(width) for _ in range(config.depth))
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.output = nn.Linear(width, 2 * config.token_dim)
        self._initialise()

    def _initialise(self):
        # As the reference: zero-initialised modulations and output, so every block starts as the identity.
        for block in self.blocks:
            nn.init.zeros_(block.modulation[-1].weight)
            nn.init.zeros_(block.modulation[-1].bias)
        for layer in (self.final_modulation[-1], self.output):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, xt: torch.Tensor, t: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.time_embed(timestep_embedding(t, self.time_frequencies).to(z.dtype)) + self.condition_embed(z)
        h = self.input_proj(xt)
        for block in self.blocks:
            h = block(h, y)
        shift, scale = self.final_modulation(y).chunk(2, dim=-1)
        return self.output(_modulate(self.final_norm(h), shift, scale)).chunk(2, dim=-1)


@dataclass
class DiffusionSample:
    """Tokens drawn by a diffusion head, with the Gaussian of the final reverse step that gave them.

    Given the trajectory up to ``x_1``, the final step is ``N(final_mean, final_std^2)`` (the std already
    multiplied by the temperature). With `DiffusionHeadConfig.final_step_noise` the token is a draw
    from it; without (MAR's sampler) the token is `final_mean` and the Gaussian is what CSpD's ratio
    reads.
    """

    tokens: torch.Tensor  # (N, D)
    final_mean: torch.Tensor  # (N, D)
    final_std: torch.Tensor  # (N, D)
    log_std_sum: torch.Tensor  # (N, D): the log stds of the trajectory's other steps, summed, without temperature

    @classmethod
    def cat(cls, samples: list[DiffusionSample], dim: int) -> DiffusionSample:
        """Samples joined along `dim` field by field."""
        return cls(*(torch.cat([getattr(s, f.name) for s in samples], dim=dim) for f in fields(cls)))

    def map(self, function) -> DiffusionSample:
        """The same sample with `function` applied to every field (a reshape, an index)."""
        return DiffusionSample(*(function(getattr(self, f.name)) for f in fields(self)))


class DiffusionHead(nn.Module):
    """The denoising MLP with its training process and its respaced sampling process."""

    def __init__(self, config: DiffusionHeadConfig):
        super().__init__()
        self.config = config
        self.net = DenoisingMLP(config)
        self.training_process = NoiseProcess.respaced(config.training_steps, config.training_steps)
        self.sampling_process = NoiseProcess.respaced(config.training_steps, config.sampling_steps)

    @property
    def noise_steps(self) -> int:
        """Noise vectors one sampled token consumes: ``x_T`` and one per reverse step that adds noise."""
        return len(self.sampling_process) + int(self.config.final_step_noise)

    def loss(self, z: torch.Tensor, target: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-token training loss (N,) for tokens (N, D) given their conditions (N, H).

        MSE between predicted and true noise at a uniformly drawn step, plus the variational
        bound's KL for the learned variance with the predicted mean held fixed (MAR's `learn_sigma`).
        """
        process = self.training_process
        step = torch.randint(0, len(process), (target.shape[0],), device=target.device, generator=generator)
        noise = torch.randn(target.shape, device=target.device, dtype=target.dtype, generator=generator)
        xt = process.noised(target, step, noise)
        eps, variance_frac = self.net(xt, process.timesteps[step], z)
        mse = (eps - noise).pow(2).mean(-1)
        mean, log_var = process.reverse(xt, step, eps.detach(), variance_frac)
        true_mean, true_log_var = process.posterior(target, xt, step)
        kl = 0.5 * (
            log_var - true_log_var + (true_log_var - log_var).exp() + (true_mean - mean).pow(2) / log_var.exp() - 1
        )
        # At step 0 the bound's term is the data's negative log-likelihood under p(x_0 | x_1).
        nll = 0.5 * (math.log(2 * math.pi) + log_var + (target - mean).pow(2) / log_var.exp())
        vb = torch.where(step[:, None] == 0, nll, kl).mean(-1) / math.log(2)
        return mse + vb * len(process) / 1000.0  # guided-diffusion's RESCALED_MSE weighting of the bound

    def sample(
        self,
        z: torch.Tensor,
        noise: torch.Tensor,
        cfg_scale: float | torch.Tensor = 1.0,
        temperature: float = 1.0,
        guided: bool = False,
    ) -> DiffusionSample:
        """Draw tokens (N, D) given conditions z ((2N, H) as [cond; uncond] when `guided`, else (N, H)).

        `cfg_scale` mixes the guided twins' noise predictions, one number or one per token ((N, 1)).

        `noise` (N, noise_steps, D): ``noise[:, 0]`` is ``x_T``, ``noise[:, k]`` the noise of the k-th
        reverse step. The same arithmetic as `DenoisingMLP.forward` and `NoiseProcess.reverse` step by
        step (tests/test_diffusion_head.py compares them), arranged in fewer kernels: a sampled token
        costs `sampling_steps` network calls, each too small for its kernels' launch costs to be
        negligible, and it is paid for every token of every method. Computed in z's dtype.
        """
        if noise.shape[1] != self.noise_steps:
            raise ValueError(f"diffusion noise has {noise.shape[1]} steps, this head takes {self.noise_steps}")
        net, process, dtype = self.net, self.sampling_process, z.dtype
        steps, width, depth = len(process), net.width, len(net.blocks)
        # What does not change from step to step: the condition's embedding, every timestep's embedding,
        # and all the AdaLN modulations as one product of SiLU(y) with their weights side by side.
        condition = net.condition_embed(z)  # (rows, W)
        times = net.time_embed(timestep_embedding(process.timesteps.to(z.device), net.time_frequencies).to(dtype))
        modulation_weight = torch.cat([b.modulation[-1].weight for b in net.blocks] + [net.final_modulation[-1].weight])
        modulation_bias = torch.cat([b.modulation[-1].bias for b in net.blocks] + [net.final_modulation[-1].bias])
        a = process.alphas_cumprod.tolist()
        coef_x0, coef_xt = process.posterior_mean_x0.tolist(), process.posterior_mean_xt.tolist()
        min_logs, max_logs = process.posterior_log_variance.tolist(), process.log_betas.tolist()
        x = noise[:, 0].to(dtype)
        log_std_sum = torch.zeros_like(x)
        for k, step in enumerate(range(steps - 1, -1, -1), start=1):
            inputs = torch.cat([x, x]) if guided else x
            y = nn.functional.silu(condition + times[step])
            modulations = nn.functional.linear(y, modulation_weight, modulation_bias).split(width, dim=-1)
            h = net.input_proj(inputs)
            for i, block in enumerate(net.blocks):
                shift, scale, gate = modulations[3 * i : 3 * i + 3]
                normed = torch.addcmul(shift, block.norm(h), 1 + scale)
                h = torch.addcmul(h, gate, block.mlp(normed))
            shift, scale = modulations[3 * depth :]
            eps, variance_frac = net.output(torch.addcmul(shift, net.final_norm(h), 1 + scale)).chunk(2, dim=-1)
            if guided:
                cond, uncond = eps.chunk(2)
                eps, variance_frac = torch.lerp(uncond, cond, cfg_scale), variance_frac.chunk(2)[0]
            x0 = (x - math.sqrt(1 - a[step]) * eps) / math.sqrt(a[step])
            if self.config.clip_denoised:
                x0 = x0.clamp(-1, 1)
            mean = coef_x0[step] * x0 + coef_xt[step] * x
            log_var = min_logs[step] + (variance_frac + 1) * (0.5 * (max_logs[step] - min_logs[step]))
            std = (0.5 * log_var).exp() * temperature
            if step == 0:
                tokens = torch.addcmul(mean, std, noise[:, k].to(dtype)) if self.config.final_step_noise else mean
                return DiffusionSample(tokens=tokens, final_mean=mean, final_std=std, log_std_sum=log_std_sum)
            log_std_sum = log_std_sum + 0.5 * log_var  # (the reference's relaxed CSpD test reads it)
            x = torch.addcmul(mean, std, noise[:, k].to(dtype))
        raise AssertionError("unreachable: the loop returns at step 0")
