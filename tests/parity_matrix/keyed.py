"""Dropout that one process and every layout draw alike, so dropout cases are judged too.

A mask is a function of (the dropout's place in the model, the sample, the position in
the sample's activation), not of a generator's state: one process on the whole batch
and any layout that cuts it (data replicas, tensor-parallel batch gathering and heads,
microbatches, pipeline stages, recomputation) draw the same mask for the same element.
The library's own random numbers are proven apart (tests/distributed/test_randomness.py).

- Every sample carries its number in the input (:func:`encode`): token ids plus the
  vocabulary size times the number, or two extra image channels. The model's wrapper
  (:class:`Keyed`) decodes it and tells the dropouts which samples its forward runs.
- :class:`KeyedDropout` replaces every ``nn.Dropout``; Hugging Face attention runs
  :func:`keyed_attention` (their eager attention with a keyed dropout on the weights).
  A tensor-parallel rank holds some heads of the attention weights: its mask is cut from
  the whole row's at its heads' offset.
- Recomputation (activation checkpointing) calls a dropout again outside the forward
  that knew the samples: it finds them by the input's bytes, which recomputation
  reproduces exactly.
- Context parallelism: a rank holds two chunks of each sequence. Its hidden-state masks
  are cut from the whole sequence's at its global positions, and its attention is the
  library's ring attention with masks cut from the whole (sample, head, query, key)
  mask (:func:`transform`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# numbers of samples in images: two channels of values below this, exact in bf16 and fp16
_IMAGE_BASE = 128


@dataclass
class Samples:
    """The samples of the forward running now, and those a recomputation may meet."""

    running: torch.Tensor | None = None
    seen: dict[tuple[int, bytes], torch.Tensor] = field(default_factory=dict)
    # context parallelism: the global positions of a rank's sequence, and the whole length
    positions: torch.Tensor | None = None
    length: int = 0
    # a mixture-of-experts model's weighted load-balancing loss of the last forward (its
    # Hugging Face output's, added to the loss only when labels are passed)
    router_loss: torch.Tensor | None = None


def encode(x: torch.Tensor, first: int, vocab: int) -> torch.Tensor:
    """``x`` (token ids, or images) with samples numbered from ``first``."""
    numbers = torch.arange(first, first + x.shape[0])
    if x.is_floating_point():
        extra = torch.stack([numbers // _IMAGE_BASE, numbers % _IMAGE_BASE], dim=1)
        extra = extra.to(x.dtype)[:, :, None, None].expand(-1, -1, *x.shape[2:])
        return torch.cat([x, extra], dim=1)
    return x + vocab * numbers[:, None]


def decode(x: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's input, the numbers of its samples)."""
    if x.is_floating_point():
        hi, lo = x[:, -2, 0, 0].round().long(), x[:, -1, 0, 0].round().long()
        return x[:, :-2], hi * _IMAGE_BASE + lo
    return x % vocab, x[:, 0] // vocab


class Keyed(nn.Module):
    """A zoo model as a function of encoded inputs returning logits."""

    samples: Samples

    def __init__(self, model: nn.Module, vocab: int, hugging_face: bool):
        super().__init__()
        self.model = model
        self.vocab = vocab
        self.hugging_face = hugging_face
        samples = Samples()
        object.__setattr__(self, "samples", samples)  # shared, not a submodule
        index = 0
        for owner in list(model.modules()):
            for name, child in list(owner.named_children()):
                if isinstance(child, nn.Dropout):  # the reference attention's: its heads
                    heads = getattr(owner, "n_heads", None) if name == "attn_dropout" else None
                    setattr(owner, name, KeyedDropout(child.p, index, samples, heads))
                    index += 1
            if hugging_face and type(owner).__name__.endswith("Attention") \
                    and hasattr(owner, "config"):  # keyed_attention drops its weights
                heads = getattr(owner, "config").num_attention_heads  # noqa: B009
                owner.keyed_weights_dropout = KeyedDropout(0.0, index, samples, heads)
                index += 1

    def decode_inside(self) -> None:
        """Decode the samples where the wrapped model's own pre-hooks have run (register
        after ``mp.transform`` of ``self.model``): its tensor-parallel batch gathering
        then gathers the numbers with the rows."""
        self.decoding_inside = True

        def decode_gathered(module: nn.Module, args: tuple) -> tuple:
            x, numbers = decode(args[0], self.vocab)
            self.samples.running = None if x.is_meta else numbers
            return (x, *args[1:])

        self.model.register_forward_pre_hook(decode_gathered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "decoding_inside", False):
            return self._outputs(self.model(x))  # decoded by decode_gathered
        x, numbers = decode(x, self.vocab)
        self.samples.running = None if x.is_meta else numbers
        split = _sequence_split(self.model)
        if split is not None:  # this rank's chunks of each sequence
            from modelparallel.parallel.context_parallel.split import positions

            self.samples.positions = positions(split.cp_rank, split.cp_size, x.shape[1])
            self.samples.length = split.cp_size * x.shape[1]
        return self._outputs(self.model(x))

    def _outputs(self, out: Any) -> torch.Tensor:
        if not self.hugging_face:
            return out
        aux = getattr(out, "aux_loss", None)
        self.samples.router_loss = None if aux is None else \
            getattr(self.model, "router_aux_loss_coef") * aux  # noqa: B009 (read by forward)
        return out.logits


class KeyedDropout(nn.Module):
    """``nn.Dropout`` whose mask is a function of (``index``, sample, position).

    ``heads``: attention weights, ``(batch, heads, ...)``, of which a tensor-parallel
    rank holds a consecutive share of the model's ``heads``."""

    samples: Samples

    def __init__(self, p: float, index: int, samples: Samples, heads: int | None = None):
        super().__init__()
        self.p = p
        self.index = index
        self.heads = heads
        object.__setattr__(self, "samples", samples)

    def forward(self, x: torch.Tensor, p: float | None = None) -> torch.Tensor:
        p = self.p if p is None else p
        if not self.training or p == 0 or x.is_meta:  # (meta: a pipeline's shape inference)
            return x
        numbers = self._numbers(x)
        rest, positions = list(x.shape[2:]), self.samples.positions
        if self.heads is not None:  # (B, heads, ...): a tensor-parallel rank holds some
            keep = self.masks(numbers, [self.heads, *rest], p, local_heads=x.shape[1])
        elif positions is not None:  # (B, S, ...): a context-parallel rank's positions
            keep = self.masks(numbers, [self.samples.length, *rest], p)[:, positions]
        else:
            keep = self.masks(numbers, list(x.shape[1:]), p)
        return x * keep.to(device=x.device, dtype=x.dtype) * (1.0 / (1.0 - p))

    def masks(self, numbers: torch.Tensor, shape: list[int], p: float,
              local_heads: int | None = None) -> torch.Tensor:
        """Each sample's keep-mask of the whole tensor's ``shape`` (one process's); with
        ``local_heads``, cut to this tensor-parallel rank's heads (the first dim)."""
        keep = torch.stack([_uniform(self.index, int(n), shape) >= p for n in numbers.tolist()])
        if local_heads is not None and local_heads != shape[0]:
            first = _tp_rank() * local_heads
            keep = keep[:, first:first + local_heads]
        return keep

    def _numbers(self, x: torch.Tensor) -> torch.Tensor:
        key = (self.index, hashlib.blake2b(
            x.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
            digest_size=16).digest())
        seen = self.samples.seen.get(key)
        if seen is not None:  # a recomputation of a forward that ran before
            return seen
        running = self.samples.running
        if running is None or running.shape[0] != x.shape[0]:
            raise RuntimeError(f"keyed dropout {self.index}: called outside the model's "
                               "forward, or on other rows than its input's")
        self.samples.seen[key] = running
        return running


def _uniform(index: int, sample: int, shape: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(
        f"{index}/{sample}".encode(), digest_size=7).digest(), "little"))
    return torch.rand(shape, generator=g)


def _tp_rank() -> int:
    import modelparallel as mp

    return mp.tp_rank() if mp.state.initialized else 0


# -- Hugging Face attention ------------------------------------------------------------------

ATTENTION = "modelparallel_keyed"


def register_attention() -> None:
    """Make ``attn_implementation="modelparallel_keyed"`` known to transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(ATTENTION, keyed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)


def keyed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's eager attention, its weights dropped by the module's keyed dropout;
    under context parallelism the library's ring attention, dropping the same weights."""
    split = _sequence_split(module)
    if split is not None:
        return _keyed_ring_attention(module, query, key, value, split, scaling, dropout), None
    groups = query.shape[1] // key.shape[1]  # grouped-query attention
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = query @ key.transpose(2, 3) * scale
    if attention_mask is not None:
        weights = weights + attention_mask[..., :key.shape[-2]]
    # float32 at least, as Hugging Face's eager attention; float64 stays float64 (the
    # float64 rerun's answer must be exact where ring attention computes in float64)
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)
    weights = weights.softmax(dim=-1, dtype=softmax_dtype).to(query.dtype)
    dropped: KeyedDropout = module.keyed_weights_dropout  # type: ignore[assignment]
    weights = dropped(weights, p=dropout)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _sequence_split(module: nn.Module):
    """How context parallelism splits ``module``'s sequences, or None."""
    from modelparallel.module_state import lookup

    return lookup(module, "context_parallel")


def _keyed_ring_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, split, scaling: float | None,
                          dropout: float) -> torch.Tensor:
    """Ring attention whose masks are cut from the whole sequence's keyed mask of each
    sample (the one :func:`keyed_attention` draws on one process)."""
    from modelparallel.parallel.context_parallel.ring import ring_attention

    masks = None
    dropped: KeyedDropout = module.keyed_weights_dropout  # type: ignore[assignment]
    if dropout and module.training:
        numbers = dropped._numbers(query)  # found again by the bytes when recomputed
        length = split.cp_size * query.shape[2]
        assert dropped.heads is not None  # attention weights' dropout: keyed by heads
        whole = dropped.masks(numbers, [dropped.heads, length, length], dropout,
                              local_heads=query.shape[1]).to(query.device)

        def masks(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            return whole[:, :, rows][..., cols]

    out = ring_attention(query, key, value, split.group, split.comm_type, scaling,
                         dropout if masks is not None else 0.0, masks)
    return out.transpose(1, 2).contiguous()


def transform(mp, model: nn.Module, context_parallel: bool) -> nn.Module:
    """``mp.transform`` of a zoo model. Context parallelism replaces only the attention
    implementations users set (eager, sdpa): keyed attention is set back after it, and
    then runs the ring itself (:func:`keyed_attention`)."""
    from modelparallel.parallel.context_parallel.hugging_face import find_causal_lm

    causal_lm = find_causal_lm(model) if context_parallel else None
    keyed = causal_lm is not None and causal_lm.config._attn_implementation == ATTENTION
    if keyed:
        causal_lm.set_attn_implementation("eager")
    model = mp.transform(model)
    if keyed:
        causal_lm.set_attn_implementation(ATTENTION)
    return model
