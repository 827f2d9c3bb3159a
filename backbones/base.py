"""The one interface `train/` and `decode/` know about a frozen AR image model.

Every family (the embedded digits model, Emu3, Janus-Pro, Lumina-mGPT, LlamaGen,
Tar) implements `ARImageBackbone`. The decoders speak *grid positions* and
*codebook ids* only:

- token ``i`` of an image is grid cell ``(i // cols, i % cols)``; its value is a
  codebook index in ``[0, codebook_size)`` (the backbone maps it to its own
  vocabulary id);
- a hidden state is indexed by the grid position it *predicts*: ``hidden[:, i]``
  is the last-layer state (before the final norm) whose logits give the
  distribution of token ``i``. Families whose flat sequence ends each row with an
  end-of-line token (Emu3, Lumina-mGPT) insert it inside `step`, and the hidden
  returned for the last token of a row is the end-of-line token's, the one that
  predicts the first token of the next row. The spatial offsets of the draft
  heads (+1, +cols) are therefore the same for every family.

Classifier-free guidance runs the conditional and unconditional twins as one
batch ``[cond; uncond]`` of ``2B`` rows; `guide` mixes their logits the family's
way (on logits for Janus/LlamaGen, on log-probabilities for Emu3/Lumina-mGPT).
"""

from __future__ import annotations

import copy
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy
import torch
from torch import nn

from backbones.kv_cache import keep_rows, keep_slots, preallocated_cache, ragged_slots, reserve, writing_at
from backbones.ragged_attention import attending_own_keys


@dataclass(frozen=True)
class ImageGeometry:
    """Where an image's tokens sit in the backbone's flat sequence."""

    rows: int
    cols: int
    end_of_line: bool = False  # True: an end-of-line token follows every row (Emu3, Lumina-mGPT)

    @property
    def num_tokens(self) -> int:
        """Image tokens per image (end-of-line tokens excluded)."""
        return self.rows * self.cols

    @property
    def row_stride(self) -> int:
        """Distance in the flat sequence between a token and the one below it."""
        return self.cols + int(self.end_of_line)

    def flat_length(self, num_image_tokens: int) -> int:
        """Flat-sequence length of the first `num_image_tokens` grid tokens (with their EOLs)."""
        return num_image_tokens + (num_image_tokens // self.cols if self.end_of_line else 0)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "cols": self.cols, "end_of_line": self.end_of_line}


@dataclass
class Condition:
    """What to generate: class ids for class-conditional models, prompts for text-to-image ones.

    `token_ids` are prompts already tokenized in the backbone's own vocabulary
    (B, L), for text-to-image backbones used without their tokenizer (tests).
    """

    class_ids: torch.Tensor | None = None  # (B,) long
    prompts: list[str] | None = None
    token_ids: torch.Tensor | None = None  # (B, L) long

    def __post_init__(self):
        given = sum(x is not None for x in (self.class_ids, self.prompts, self.token_ids))
        if given != 1:
            raise ValueError("a Condition needs exactly one of class_ids, prompts or token_ids")
        if self.token_ids is not None and self.token_ids.dim() != 2:
            raise ValueError(f"Condition.token_ids must be (batch, length), got shape {tuple(self.token_ids.shape)}")

    @property
    def batch_size(self) -> int:
        if self.class_ids is not None:
            return len(self.class_ids)
        if self.prompts is not None:
            return len(self.prompts)
        return self.token_ids.shape[0]


@dataclass
class DecodeState:
    """A batch being generated: the KV cache and how far it has got.

    `cache` holds `2 * batch_size` rows ([cond; uncond]) when `guided`, else
    `batch_size`. `prefix_length` is the flat length of the prompt part, the same
    for every row.
    """

    cache: Any
    batch_size: int
    guided: bool
    prefix_length: int
    num_image_tokens: int = 0
    extras: dict = field(default_factory=dict)  # family-specific (class ids, attention masks, ...)

    @property
    def cache_rows(self) -> int:
        return 2 * self.batch_size if self.guided else self.batch_size

    def rows_of(self, images: torch.Tensor) -> torch.Tensor:
        """Image indices (k,) -> their cache rows ([cond; uncond] under guidance)."""
        return torch.cat([images, images + self.batch_size]) if self.guided else images


def contiguous_slice(vocabulary_ids: torch.Tensor) -> slice | None:
    """The slice the ids (V,) cover when they run consecutively (codebook order in the vocabulary), else None.

    A family whose image tokens are contiguous slices its head's weight (a view) instead of gathering the
    codebook's rows on every call.
    """
    first = int(vocabulary_ids[0])
    # Explicitly on the CPU: adapters may be built under a device context (meta, CUDA; backbones/published_sizes.py).
    consecutive = torch.equal(vocabulary_ids.cpu(), torch.arange(first, first + len(vocabulary_ids), device="cpu"))
    return slice(first, first + len(vocabulary_ids)) if consecutive else None


def group_by_prompt_length(
    backbone: ARImageBackbone, condition: Condition, max_batch: int | None = None
) -> list[tuple[torch.Tensor, Condition]]:
    """Split a condition into batches the adapters accept: ``[(indices, condition of those rows)]``.

    Text-to-image adapters feed a batch's prompts without padding, so prompts of
    one batch must tokenize to the same length. Prompts are tokenized one by one
    with the backbone's own `prompt_token_ids` and grouped by length (groups in
    order of first appearance, rows in their original order within a group);
    each group is a ``Condition(prompts=...)`` of its prompts. Class ids and token
    ids come back as they are, and so do the prompts of a backbone that pads them
    itself (``pads_prompts``: Harmon). `max_batch` also cuts every group into
    batches of at most that many rows.
    """
    size = condition.batch_size
    if condition.prompts is None or getattr(backbone, "pads_prompts", False):  # (Harmon pads its prompts)
        groups = [(torch.arange(size), condition)]
    else:
        tokenize = getattr(backbone, "prompt_token_ids", None)
        if tokenize is None:
            raise ValueError(
                f"{backbone.name} takes no prompts; it is class-conditional: give class ids "
                "(data.spec.conditions=class_ids for a corpus)"
            )
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(condition.prompts):
            by_length.setdefault(tokenize(Condition(prompts=[prompt])).shape[1], []).append(i)
        groups = [
            (torch.tensor(rows), Condition(prompts=[condition.prompts[i] for i in rows])) for rows in by_length.values()
        ]
    if max_batch is None:
        return groups
    return [
        (indices[start : start + max_batch], select_rows(group, slice(start, start + max_batch)))
        for indices, group in groups
        for start in range(0, len(indices), max_batch)
    ]


def select_rows(condition: Condition, rows: slice) -> Condition:
    """The condition of a slice of its rows."""
    if condition.class_ids is not None:
        return Condition(class_ids=condition.class_ids[rows])
    if condition.token_ids is not None:
        return Condition(token_ids=condition.token_ids[rows])
    return Condition(prompts=condition.prompts[rows])


def mean_prompt_embedding(embedding: nn.Module, token_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """(B, L) prompt ids -> (B, D): the mean of their input embeddings, pad tokens left out (fp32)."""
    with torch.no_grad():
        embeds = embedding(token_ids).float()  # (B, L, D)
        keep = torch.ones_like(token_ids, dtype=torch.bool) if pad_token_id is None else token_ids != pad_token_id
        keep = keep.float()[..., None]
        return (embeds * keep).sum(1) / keep.sum(1).clamp(min=1)


def pooled_prompt_embedding(
    backbone: ARImageBackbone, embedding: nn.Module, condition: Condition, pad_token_id: int | None
) -> torch.Tensor:
    """`condition_embedding` for text-to-image adapters with a `prompt_token_ids` method: (B, D) fp32.

    Prompts are tokenized one at a time, so a batch of prompts of different token
    lengths pools fine (decoding still needs equal lengths); token ids pool as given.
    """
    if condition.prompts is not None:
        rows = [backbone.prompt_token_ids(Condition(prompts=[prompt])) for prompt in condition.prompts]
    else:
        rows = [backbone.prompt_token_ids(condition)]
    device = embedding.weight.device
    return torch.cat([mean_prompt_embedding(embedding, ids.to(device), pad_token_id) for ids in rows])


@dataclass
class TreeLayout:
    """Where the nodes of a token tree go in one pass (`ARImageBackbone.step_tree`): the flat sequence with
    its end-of-line nodes, each flat node's parent, position and what it sees."""

    flat_parents: list[int]  # (T',) the flat node each flat node follows, -1: the image so far
    node_of_flat: torch.Tensor  # (T',) long: the tree node a flat node holds, -1 for an end-of-line node
    output_of_node: torch.Tensor  # (T,) long: the flat node whose hidden predicts the token after node t
    flat_of_node: list[int]  # (T,) the flat node holding tree node t
    eol_of_node: list[int]  # (T,) the end-of-line flat node after node t, -1 where none
    flat_positions: torch.Tensor  # (T',) long: flat image position of each flat node
    sees: torch.Tensor  # (T', T') bool: flat node j sees flat node i (itself and its ancestors)
    deepest: int  # the largest grid position of a node

    @staticmethod
    def build(parents: list[int], first: int, geometry: ImageGeometry) -> TreeLayout:
        """The layout of a tree whose depth-0 nodes sit at grid position `first`."""
        grid, flat_parents, node_of_flat, flat_positions = [], [], [], []
        flat_of_node, eol_of_node, output_of_node = [], [], []
        for t, parent in enumerate(parents):
            if not -1 <= parent < t:
                raise ValueError(f"tree node {t} has parent {parent}: parents must come first (-1: the image so far)")
            position = first if parent < 0 else grid[parent] + 1
            grid.append(position)
            # A node after one that ends a row follows that row's end-of-line node.
            follows = -1 if parent < 0 else (eol_of_node[parent] if eol_of_node[parent] >= 0 else flat_of_node[parent])
            flat_of_node.append(len(flat_parents))
            flat_parents.append(follows)
            node_of_flat.append(t)
            flat_positions.append(geometry.flat_length(position))
            ends_row = geometry.end_of_line and (position + 1) % geometry.cols == 0
            eol_of_node.append(len(flat_parents) if ends_row else -1)
            if ends_row:
                flat_parents.append(flat_of_node[t])
                node_of_flat.append(-1)
                flat_positions.append(geometry.flat_length(position) + 1)
            output_of_node.append(eol_of_node[t] if ends_row else flat_of_node[t])
        # In NumPy: a row copy there costs a tenth of a tensor op's dispatch (the layout of a 256-node tree: 1.4 ms
        # with this loop in torch on this CPU, 0.3 ms now).
        sees = numpy.zeros((len(flat_parents), len(flat_parents)), dtype=bool)
        for j, parent in enumerate(flat_parents):
            if parent >= 0:
                sees[j] = sees[parent]
            sees[j, j] = True
        return TreeLayout(
            flat_parents,
            torch.tensor(node_of_flat),
            torch.tensor(output_of_node),
            flat_of_node,
            eol_of_node,
            torch.tensor(flat_positions),
            torch.from_numpy(sees),
            max(grid) if grid else first,
        )

    def flat_path(self, path: torch.Tensor) -> torch.Tensor:
        """(B, k) tree nodes of each image's path, root first -> (B, k') their flat nodes, end-of-lines included."""
        rows = []
        for nodes in path.tolist():
            flat = []
            for t in nodes:
                flat.append(self.flat_of_node[t])
                if self.eol_of_node[t] >= 0:
                    flat.append(self.eol_of_node[t])
            rows.append(flat)
        return torch.tensor(rows, dtype=torch.long)


@dataclass
class TreePass:
    """What `ARImageBackbone.step_tree` returns: the nodes' hidden states and where the tree sat in the cache."""

    hidden: torch.Tensor  # (rows, T, H): hidden[:, t] predicts the grid token after node t on its path
    layout: TreeLayout
    start: int  # the cache slot of the first flat node (the cache's length before the pass)


def prefills_stay_eager(backbone: nn.Module) -> None:
    """After its passes are compiled: `backbone`'s prefills (`prefill`, `prefill_prompts`) run eager. They run once
    per image, and each of their cache layouts (a cache not allocated yet, prompt-sized caches) would compile a
    graph of its own, in the middle of a timed run (a continuous batch's first refill); the passes that decoding
    repeats compile once, in the warm-up."""
    for name in ("prefill", "prefill_prompts"):
        method = getattr(backbone, name, None)
        if method is None:
            continue

        def eager(*args, _method=method, **kwargs):
            with torch.compiler.set_stance("force_eager"):
                return _method(*args, **kwargs)

        setattr(backbone, name, eager)


def raise_recompile_limit(limit: int = 64) -> None:
    """Let one compiled pass module hold `limit` graphs. Each kind of pass (a one-token step, a multi-token step,
    ragged, tree and position-addressed passes, with and without guidance) compiles a graph of its own; past
    dynamo's default of 8 a run of many methods would quietly fall back to eager passes for the later ones (seen
    with the 17 methods of compare_digits)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)


class CompilablePasses:
    """A backbone whose passes all run through one module (`pass_module`), which `compile_passes` compiles
    (`decode.compile`): the discrete families (`ARImageBackbone`) and the continuous ones (`ContinuousARBackbone`)."""

    def pass_module(self) -> nn.Module:
        """The transformer every pass (`prefill`, `step`, `step_ragged`, `step_at`, `step_tree`, a continuous
        backbone's `step`) runs through: what `compile_passes` compiles."""
        raise NotImplementedError(
            f"{type(self).__name__} does not name the module its passes run through, so its passes cannot be "
            "compiled; implement pass_module, or run with decode.compile=false"
        )

    def compile_passes(self) -> None:
        """Compile the backbone's passes with torch.compile, dynamic shapes (one graph serves every feed length;
        a one-token step and a multi-token pass compile apart); prefills stay eager (`prefills_stay_eager`). The
        compiled passes compute what the eager ones do up to float rounding: lossless methods stay lossless and
        greedy tokens were the same in every test, but an approximate method's sampled tokens can differ where
        rounding moves a draw across a boundary. The first pass of each kind waits for the compiler (tens of
        seconds on a CPU; the benchmark's untimed warm-up takes it). On a CPU at batch 1, where a small backbone's
        one-token step is mostly Python and kernel-launch overhead, this is the baseline's fastest form; at batch
        16 it is not (docs/results.md)."""
        raise_recompile_limit()
        self._compile_pass_module()
        prefills_stay_eager(self)

    def _compile_pass_module(self) -> None:
        """The compiling step of `compile_passes`: the pass module's call (a family whose passes call another
        method of it compiles that one instead)."""
        self.pass_module().compile(dynamic=True)


class ContinuousBatching:
    """The cache-row operations of continuous batching, shared by discrete and continuous backbones: a queue's
    prompts prefilled ahead (`prefill_prompts`), a finished image's slot handed to the next (`replace_images`) and
    finished slots dropped from the batch (`keep_images`). They work on any `DecodeState` whose cache is
    preallocated (backbones/kv_cache.py) and whose extras hold one row per cache row; the caches themselves are
    sized here (`image_cache`), for the whole image or, inside `prefill_prompts`, the prompt alone."""

    def cache_capacity(self, prefix_length: int) -> int:
        """Cache positions of the prompt and the whole image (with its end-of-line tokens); the prompt's alone
        inside `prefill_prompts`."""
        if getattr(self, "_prompt_caches_only", False):
            return prefix_length
        return prefix_length + self.geometry.flat_length(self.geometry.num_tokens)

    def image_cache(self, num_layers: int, prefix_length: int):
        """A KV cache preallocated for the prompt and the whole image (`cache_capacity`).

        Appending writes in place (backbones/kv_cache.py): transformers' DynamicCache copies the
        whole cache on every pass, which makes the baseline slower than it needs to be.
        """
        return preallocated_cache(num_layers, self.cache_capacity(prefix_length))

    def prefill_prompts(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        """`prefill` into caches sized for the prompts alone: images of a continuous batch's queue prefilled
        ahead of their slots, whose prompt part `replace_images` copies into the running batch (a cache for
        the whole image per queued image would double a batch's memory). The state can take no `step`."""
        self._prompt_caches_only = True
        try:
            return self.prefill(condition, guided)
        finally:
            self._prompt_caches_only = False

    def _ragged_pass(self, state: DecodeState, inputs: torch.Tensor, starts: torch.Tensor, forward) -> torch.Tensor:
        """The layout of a ragged pass around the family's forward: row ``b`` of `inputs` (B, width, ...) is written
        at consecutive cache slots from its (flat) image position ``starts[b]``, each input seeing its row's slots
        up to its own; ``forward(inputs, slots, visible, positions)`` runs inside `writing_at`, with both twins'
        rows under guidance. Attention reads up to the furthest slot fed, not the whole buffer (a pass early in
        the image costs what `step` costs there, not what the end would), and each group of rows only up to its own
        furthest slot (backbones/ragged_attention.py: an image that just entered its slot does not read up to its
        neighbour's end)."""
        capacity = self.cache_capacity(state.prefix_length)
        slots, attend, visible = ragged_slots(state.cache, state.prefix_length + starts, inputs.shape[1], capacity)
        positions = slots.clamp(max=capacity - 1)  # padding past the image's end: any position, never seen
        if state.guided:
            inputs, slots, visible, positions = (torch.cat([x, x]) for x in (inputs, slots, visible, positions))
        with writing_at(state.cache, slots, attend), attending_own_keys(self, slots):
            return forward(inputs, slots, visible, positions)

    def replace_images(
        self, state: DecodeState, images: torch.Tensor, fresh: DecodeState, fresh_images: torch.Tensor | None = None
    ) -> None:
        """Continuous batching: images ``images`` (k,) of `state` start over as the k images ``fresh_images`` (k,)
        of `fresh` (a new `prefill` or `prefill_prompts` of their conditions; default: all of its images): the
        prompt part of their cache rows (both twins under guidance) and their family extras (class ids, prompt
        masks) are copied in. Their image slots are left as they are (stale, overwritten by the next ragged
        passes). Needs the same prompt length and guidance."""
        if fresh.prefix_length != state.prefix_length or fresh.guided != state.guided:
            raise ValueError(
                f"replace_images needs the same prompt length and guidance: the batch has {state.prefix_length} "
                f"prompt slots (guided={state.guided}), the new images {fresh.prefix_length} "
                f"(guided={fresh.guided}); group the queue by prompt length (backbones.base.group_by_prompt_length)"
            )
        if fresh_images is None:
            fresh_images = torch.arange(fresh.batch_size, device=images.device)
        if images.shape[0] != fresh_images.shape[0]:
            raise ValueError(f"replace_images got {images.shape[0]} images for {fresh_images.shape[0]} new ones")
        rows, fresh_rows = state.rows_of(images), fresh.rows_of(fresh_images)
        prefix = state.prefix_length
        for layer, new in zip(state.cache.layers, fresh.cache.layers):
            for name in ("_key_buffer", "_value_buffer"):
                buffer = getattr(layer, name)
                buffer[rows.to(buffer.device), :, :prefix] = getattr(new, name)[
                    fresh_rows.to(buffer.device), :, :prefix
                ]
        for key, value in fresh.extras.items():
            if isinstance(value, torch.Tensor) and value.shape[0] == fresh.cache_rows:
                state.extras[key][rows.to(value.device)] = value[fresh_rows.to(value.device)]
            else:
                raise ValueError(f"replace_images cannot merge {type(self).__name__}'s extra {key!r} row by row")

    def keep_images(self, state: DecodeState, images: torch.Tensor) -> None:
        """Continuous batching's drain: `state` keeps only the images ``images`` (k,), in this order (their cache
        rows, both twins under guidance, and their family extras), so that later passes compute no finished
        image's rows. One copy of the kept rows; ``state.batch_size`` becomes k."""
        if images.dim() != 1 or not 0 < images.shape[0] <= state.batch_size:
            raise ValueError(
                f"keep_images needs 1 to {state.batch_size} image indices, got shape {tuple(images.shape)}"
            )
        rows = state.rows_of(images)
        keep_rows(state.cache, rows)
        for key, value in state.extras.items():
            if not (isinstance(value, torch.Tensor) and value.shape[0] == state.cache_rows):
                raise ValueError(f"keep_images cannot select {type(self).__name__}'s extra {key!r} row by row")
            state.extras[key] = value.index_select(0, rows.to(value.device))
        state.batch_size = int(images.shape[0])


class ARImageBackbone(CompilablePasses, ContinuousBatching, nn.Module, ABC):
    """A frozen autoregressive image generator behind a small, family-agnostic API."""

    geometry: ImageGeometry
    codebook_size: int
    hidden_size: int
    cfg_space: Literal["logits", "logprobs"]  # where `guide` mixes cond and uncond
    name: str  # the model id, shown in errors and stored with exported heads

    # ---- the model itself (family-specific) ----------------------------------------------

    @abstractmethod
    def prefill(self, condition: Condition, guided: bool) -> tuple[DecodeState, torch.Tensor]:
        """Run the condition (and its unconditional twin when `guided`) into a new KV cache.

        Returns the state and the hidden state (rows, 1, hidden) predicting grid token 0.
        """

    @abstractmethod
    def _forward_flat(self, state: DecodeState, flat_tokens: torch.Tensor) -> torch.Tensor:
        """Append flat tokens (rows, T') to the cache; return pre-norm hidden states (rows, T', hidden).

        `flat_tokens` are codebook ids, with -1 where the family's end-of-line token goes.
        """

    # True: the final norm and the image head compute in float32 when the model is in half precision, on float32
    # copies (0.5 GB for Emu3's 32,768 x 4,096 image rows). Off by default, measured (tests/test_lossless_bf16.py):
    # on the bf16 16x16 Lumina/Janus/Emu3 it halves how much a position's guided scores depend on the length of the
    # pass that computes them, but the transformer layers' bf16 products dominate what is left, and greedy
    # speculative decoding leaves greedy AR as often as with the model's own bf16 head (always at rounding ties).
    float32_head: bool = False

    final_norm: nn.Module  # the model's last norm, applied before the image head

    def image_head_weight(self) -> torch.Tensor:
        """(codebook_size, hidden): the output projection's rows for image tokens, in codebook order.

        Families whose image head is not one linear map override `image_head` and `float32_image_head` instead.
        """
        raise NotImplementedError(f"{type(self).__name__} has no linear image head")

    def image_head(self, normed: torch.Tensor) -> torch.Tensor:
        """The image head in the model's own dtype: normed hidden states (..., hidden) -> (..., codebook_size)."""
        return nn.functional.linear(normed, self.image_head_weight())

    def float32_image_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A float32 copy of `image_head` (only the image rows of the output projection are copied)."""
        weight = self.image_head_weight().detach().float().clone()
        return lambda normed: nn.functional.linear(normed, weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + image head restricted to image tokens: (..., hidden) -> (..., codebook_size).

        In float32 when `float32_head` is set and the model is in another dtype: the norm and the head then run on
        float32 copies, built on first use and rebuilt when the model moves or its final norm's weights change
        (the backbone is frozen; change its weights only through `load_state_dict` or `.to`, which both see).
        """
        if not self.float32_head:
            return self.native_logits(hidden)
        norm, head = self._float32_head_copies()
        return head(norm(hidden.float()))

    def native_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`logits` as the model computes them, in its own dtype (what its own generation code does)."""
        return self.image_head(self.final_norm(hidden))

    def _float32_head_copies(self, keep: bool = True) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
        """Float32 copies of the final norm and the image head; `keep`: cached for the next call.

        A float32 model's own norm and head (nothing to copy).
        """
        if next(self.final_norm.parameters()).dtype == torch.float32:
            return self.final_norm, self.image_head
        # Kept out of the module tree (object.__setattr__): `.to(bfloat16)` must not cast the copies, and the state
        # dict must not carry them. The key sees `.to(...)` (new storage) and `load_state_dict` (version bump).
        key = tuple((p.device, p.data_ptr(), p._version) for p in self.final_norm.parameters())
        cached = self.__dict__.get("_float32_head_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, copy.deepcopy(self.final_norm).float(), self.float32_image_head())
            if keep:
                object.__setattr__(self, "_float32_head_cache", cached)
        return cached[1], cached[2]

    @abstractmethod
    def embed_image_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embedding of image tokens, (...,) codebook ids -> (..., hidden)."""

    @abstractmethod
    def codebook_latents(self) -> torch.Tensor:
        """(codebook_size, latent_dim): the VQ codebook vectors (for relaxed acceptance)."""

    @abstractmethod
    def tokens_to_pixels(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, rows, cols) codebook ids -> (B, channels, height, width) images in [0, 1]."""

    def pixels_to_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """(B, channels, height, width) images in [0, 1] -> (B, rows, cols) codebook ids."""
        raise NotImplementedError(f"{type(self).__name__} has no pixel encoder")

    def condition_embedding(self, condition: Condition) -> torch.Tensor:
        """(B, D) one frozen vector per prompt, which conditions a MuLo-SD drafter (heads/mulo.py).

        Text-to-image families return their input embeddings of the prompt tokens,
        mean-pooled (`mean_prompt_embedding`); class-conditional families need none
        (the drafter embeds class ids itself).
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no prompt embedding for a MuLo-SD drafter; "
            "condition the drafter on class ids, or implement condition_embedding"
        )

    # ---- shared mechanics ------------------------------------------------------------------

    def step(self, state: DecodeState, tokens: torch.Tensor) -> torch.Tensor:
        """Append grid tokens (B, T) after the ones already in `state`; return their hidden states.

        The result (rows, T, hidden) is indexed like the input: ``out[:, j]`` predicts
        the grid token after ``tokens[:, j]``. Under guidance the same tokens are
        fed to both twins.
        """
        if tokens.shape[0] != state.batch_size:
            raise ValueError(f"step got {tokens.shape[0]} rows of tokens for a batch of {state.batch_size}")
        start, count = state.num_image_tokens, tokens.shape[1]
        if start + count > self.geometry.num_tokens:
            raise ValueError(f"step would write past the image: {start} + {count} > {self.geometry.num_tokens}")
        if state.guided:
            tokens = torch.cat([tokens, tokens], dim=0)
        flat, take = self._insert_end_of_line(tokens, start)
        hidden = self._forward_flat(state, flat)
        state.num_image_tokens = start + count
        return hidden if take is None else hidden[:, take]

    def step_at(self, state: DecodeState, flat_tokens: torch.Tensor, flat_positions: torch.Tensor) -> torch.Tensor:
        """ZipAR's pass: flat image tokens (B, T) (-1: end-of-line) written at flat image positions (T,), each
        attending to every cache slot up to its own; returns their hidden states (rows, T, H).

        Slots not written yet hold zero keys and values (ZipAR's static cache); a slot written again is
        overwritten. The cache's length afterwards covers the furthest slot: `step` and `rollback` are not
        meant to follow. Under guidance both twins get the same tokens.
        """
        if flat_tokens.shape[0] != state.batch_size:
            raise ValueError(f"step_at got {flat_tokens.shape[0]} rows of tokens for a batch of {state.batch_size}")
        if state.guided:
            flat_tokens = torch.cat([flat_tokens, flat_tokens], dim=0)
        capacity = self.cache_capacity(state.prefix_length)
        slots = state.prefix_length + flat_positions.to(flat_tokens.device)
        if bool((slots >= capacity).any()):
            raise ValueError(f"step_at: flat positions past the image ({int(flat_positions.max())})")
        visible = torch.arange(capacity, device=slots.device)[None, :] <= slots[:, None]  # (T, capacity)
        with writing_at(state.cache, slots):
            return self._forward_flat_at(state, flat_tokens, slots, visible)

    def _forward_flat_at(
        self,
        state: DecodeState,
        flat_tokens: torch.Tensor,
        slots: torch.Tensor,
        visible: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`_forward_flat` at cache slots (T,), query t seeing the slots ``visible[t]`` (T, capacity), at sequence
        positions `positions` (T,) (default: the slots themselves; a token tree's nodes sit at scratch slots)."""
        raise NotImplementedError(f"{type(self).__name__} has no position-addressed passes (ZipAR)")

    def step_tree(self, state: DecodeState, tokens: torch.Tensor, parents: torch.Tensor) -> TreePass:
        """Verify a token tree in one pass: each node sees the image so far and its own ancestors only.

        tokens (B, T) codebook ids, one tree shape for the batch; parents (T,) long: ``parents[t] < t`` is the
        node it follows, -1 for the nodes that follow the image so far (siblings of the next position). Node
        ``t`` sits at grid position ``num_image_tokens + depth(t)`` with the positions and 2D layout a single
        candidate gets there (families with end-of-line tokens get one after each node ending a row, as a
        child of it). Nodes are written at scratch slots after the cache's end (grown when needed); the
        cache's length and `state` do not move until `keep_tree_path`. Returns the `TreePass`, whose
        ``hidden[:, t]`` (rows, T, H) predicts the grid token after node ``t`` on its path, as `step` would
        return it after feeding that path.
        """
        if tokens.shape[0] != state.batch_size or tokens.shape[1] != parents.shape[0]:
            raise ValueError(
                f"step_tree got tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} for a batch of "
                f"{state.batch_size}: give (batch, nodes) tokens and one parent per node"
            )
        if parents.shape[0] == 0:
            raise ValueError("step_tree needs a tree of at least one node")
        layout = TreeLayout.build(parents.tolist(), state.num_image_tokens, self.geometry)
        if layout.deepest >= self.geometry.num_tokens:
            raise ValueError(f"step_tree would write past the image: grid position {layout.deepest}")
        start = state.cache.get_seq_length()
        if start != state.prefix_length + self.geometry.flat_length(state.num_image_tokens):
            raise ValueError("step_tree needs a cache that holds exactly the image so far (roll back first)")
        device = tokens.device
        flat = tokens[:, layout.node_of_flat.clamp(min=0).to(device)]
        flat = flat.masked_fill((layout.node_of_flat < 0).to(device)[None], -1)  # end-of-line nodes
        if state.guided:
            flat = torch.cat([flat, flat], dim=0)
        count = len(layout.flat_parents)
        width = reserve(state.cache, max(self.cache_capacity(state.prefix_length), start + count))
        slots = start + torch.arange(count, device=device)
        visible = torch.zeros(count, width, dtype=torch.bool, device=device)
        visible[:, :start] = True
        visible[:, start : start + count] = layout.sees.to(device)
        positions = state.prefix_length + layout.flat_positions.to(device)
        with writing_at(state.cache, slots):
            hidden = self._forward_flat_at(state, flat, slots, visible, positions=positions)
        state.cache.crop(-count)  # the scratch slots stay beyond the length until keep_tree_path
        return TreePass(hidden[:, layout.output_of_node.to(device)], layout, start)

    def keep_tree_path(self, state: DecodeState, tree: TreePass, path: torch.Tensor, keep: int) -> None:
        """After a `step_tree`, make the first `keep` nodes of each image's accepted path the cache's continuation.

        path (B, k >= keep) long: the nodes of each image's path, root first (entries past `keep` are ignored).
        Their keys and values (with their end-of-line tokens) move to the slots they would have had if fed by
        `step`; the rejected branches are dropped. `state.num_image_tokens` grows by `keep`.
        """
        if keep == 0:
            return
        flat_path = tree.layout.flat_path(path[:, :keep].cpu())  # (B, flat length of keep tokens)
        if state.guided:
            flat_path = torch.cat([flat_path, flat_path], dim=0)
        keep_slots(state.cache, tree.start + flat_path, tree.start)
        state.num_image_tokens += keep

    def step_ragged(self, state: DecodeState, tokens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Each image feeds its own run of grid tokens from its own position, all in one pass.

        tokens (B, T) codebook ids: image ``b``'s go to grid positions ``starts[b] .. starts[b] + T - 1``; pad a
        shorter run with any ids (their states are computed and ignored). Each token sees its image's prompt,
        its image's cache slots before its own position and the tokens before it in this run, with the
        position ids and 2D layout `step` gives it there, so ``out[b, j]`` equals what `step` returns for
        that token after feeding the image's first ``starts[b] + j`` tokens. The caller keeps, per image, how
        far the cache is final: slots from ``starts[b]`` on are overwritten by this pass, slots after its run
        keep stale entries that no later query sees unless re-fed. `state.num_image_tokens` and the cache's
        own length are not maintained (mix no `step` or `rollback` with ragged passes); the cache grows past the
        image (`kv_cache.ragged_slots`) so that a padded run near its end has room. Families with end-of-line tokens
        get them inside each image's run. Returns (rows, T, H), indexed like `tokens`.
        """
        batch, count = tokens.shape
        if batch != state.batch_size or starts.shape != (batch,):
            raise ValueError(
                f"step_ragged got tokens {tuple(tokens.shape)} and starts {tuple(starts.shape)} for a batch of "
                f"{state.batch_size}: give (batch, T) tokens and one start per image"
            )
        geometry, device = self.geometry, tokens.device
        starts_list = starts.tolist()
        if min(starts_list) < 0 or max(starts_list) >= geometry.num_tokens:
            raise ValueError(f"step_ragged: starts must be grid positions in [0, {geometry.num_tokens}), got {starts}")
        if geometry.end_of_line:  # each image's run gets its own end-of-line tokens
            runs = [self._insert_end_of_line(tokens[b : b + 1], start) for b, start in enumerate(starts_list)]
            width = max(run[0].shape[1] for run in runs)
            flat = tokens.new_zeros(batch, width)
            take = torch.zeros(batch, count, dtype=torch.long, device=device)
            for b, (row, row_take) in enumerate(runs):
                flat[b, : row.shape[1]] = row[0]
                take[b] = row_take
            flat_starts = torch.tensor([geometry.flat_length(start) for start in starts_list], device=device)
        else:
            flat, take, flat_starts = tokens, None, starts
        hidden = self._ragged_pass(
            state, flat, flat_starts, lambda *layout: self._forward_flat_at(state, *layout[:3], positions=layout[3])
        )
        if take is None:
            return hidden
        take = torch.cat([take, take]) if state.guided else take
        return hidden.gather(1, take[:, :, None].expand(-1, -1, hidden.shape[-1]))

    def _insert_end_of_line(self, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Add the EOL marker (-1) after every token that ends a row; return where each hidden is."""
        if not self.geometry.end_of_line:
            return tokens, None
        cols = self.geometry.cols
        positions = torch.arange(start, start + tokens.shape[1])
        ends_row = (positions + 1) % cols == 0
        flat_columns, take, j = [], [], 0
        for k, is_end in enumerate(ends_row.tolist()):
            flat_columns.append(tokens[:, k : k + 1])
            if is_end:  # the EOL's hidden predicts the next row's first token
                flat_columns.append(torch.full_like(tokens[:, :1], -1))
                j += 1
            take.append(j)
            j += 1
        return torch.cat(flat_columns, dim=1), torch.tensor(take, device=tokens.device)

    def rollback(self, state: DecodeState, num_image_tokens: int) -> None:
        """Crop the cache back so that only the first `num_image_tokens` grid tokens remain."""
        if not 0 <= num_image_tokens <= state.num_image_tokens:
            raise ValueError(f"cannot roll back to {num_image_tokens} tokens from {state.num_image_tokens}")
        excess = state.cache.get_seq_length() - (state.prefix_length + self.geometry.flat_length(num_image_tokens))
        if excess > 0:
            state.cache.crop(-excess)  # transformers >= 5: a negative count removes that many tokens
        state.num_image_tokens = num_image_tokens

    def guide(self, logits: torch.Tensor, scale: float) -> torch.Tensor:
        """Mix a [cond; uncond] batch of logits (2B, ...) into guided scores (B, ...).

        ``u + s * (c - u)`` on logits or on log-probabilities, per `cfg_space`.
        The result is used as logits (softmax of it is the guided distribution).
        """
        cond, uncond = logits.float().chunk(2, dim=0)
        if self.cfg_space == "logprobs":
            cond, uncond = cond.log_softmax(-1), uncond.log_softmax(-1)
        return uncond + scale * (cond - uncond)

    def scores(self, state: DecodeState, hidden: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        """Hidden states of a batch (rows, T, hidden) -> next-token scores (B, T, codebook_size)."""
        logits = self.logits(hidden)
        return self.guide(logits, cfg_scale) if state.guided else logits.float()

    def draft_scorer(self, state: DecodeState, cfg_scale: float):
        """For drafting loops: hidden states of cache rows (rows, ..., hidden) -> scores (rows / twins, ..., V).

        The same scores as `scores` up to float rounding. Drafters call it once per
        drafted token, where each kernel's launch costs as much as its work, so a
        family may fold its final norm, image head and guidance into fewer
        kernels. Only drafts use it: a draft's distribution is whatever it was
        drawn from, and targets always come from `scores`.
        """
        return lambda hidden: self.scores(state, hidden, cfg_scale)

    @torch.no_grad()
    def teacher_forced_hidden(self, condition: Condition, tokens: torch.Tensor, guided: bool = False) -> torch.Tensor:
        """Hidden states for whole known images (B, N) -> (rows, N, hidden); ``out[:, i]`` predicts token i."""
        state, first = self.prefill(condition, guided)
        if tokens.shape[1] == 1:
            return first
        return torch.cat([first, self.step(state, tokens[:, :-1])], dim=1)

    def identity(self) -> dict:
        """What exported heads record and check: name, sizes, geometry and a weights fingerprint."""
        return {
            "name": self.name,
            "family": type(self).__name__,
            "hidden_size": self.hidden_size,
            "codebook_size": self.codebook_size,
            "geometry": self.geometry.to_dict(),
            "weights_fingerprint": self.weights_fingerprint(),
        }

    def weights_fingerprint(self) -> str:
        """A short hash of the output side of the model (cheap even for 8B models).

        Computed in float32 on float32 copies of the final norm and image head, so the same weights give the same
        fingerprint in any dtype they are loaded in (a bf16 checkpoint in bf16 or float32): heads trained in one
        load in the other. A half-precision model holds the copies only while this runs (0.5 GB for Emu3's image
        rows, on its device), unless `float32_head` keeps them anyway; a float32 model needs none.
        """
        hidden = torch.zeros(1, self.hidden_size, device=self._device())
        hidden[0, : min(8, self.hidden_size)] = 1.0
        with torch.no_grad():
            norm, head = self._float32_head_copies(keep=self.float32_head)
            probe = head(norm(hidden)).cpu().numpy().round(4)
        return hashlib.sha1(probe.tobytes()).hexdigest()[:12]

    def _device(self) -> torch.device:
        return next(self.parameters()).device
