"""Causal attention of one rank's queries against one rank's keys, chunk by chunk, with
the log-sum-exp a later merge needs, and its backward from the merged result.

Queries and keys are a rank's local sequence: two chunks of the whole sequence (indices
from ``split.chunks_of``). Under causal attention a query chunk sees a key chunk whole
when the key chunk comes earlier, causally when it is the same chunk, and not at all when
it comes later: pairs that see nothing are skipped, which is what balances the work.
Scores are computed in float32 at least (as the softmax of Hugging Face's eager attention is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelparallel.parallel.context_parallel.dropout import AttentionDropout


@dataclass
class Segment:
    """The keys one query chunk sees of one key block: which key chunks (0 or 1 of the
    block) and whether the last one is the query chunk itself (causal within it)."""

    keys: list[int]
    diagonal: bool


def segments(query_chunks: tuple[int, int], key_chunks: tuple[int, int]) -> list[Segment]:
    """For each of the two query chunks, the key chunks of a block it sees."""
    out = []
    for q in query_chunks:
        seen = [i for i, k in enumerate(key_chunks) if k <= q]
        out.append(Segment(seen, any(key_chunks[i] == q for i in seen)))
    return out


def _take(x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Chunks (0 and/or 1) of a local sequence ``x`` (B, H, L, D), concatenated."""
    half = x.shape[-2] // 2
    return torch.cat([x[..., i * half:(i + 1) * half, :] for i in chunks], dim=-2)


# Query rows scored at once: bounds the score matrix of a block (rows x keys) however
# long the sequence, as a fused attention kernel's tiles do.
ROW_TILE = 256


def _global_rows(query_chunk: int, half: int, first: int, count: int,
                 device: torch.device) -> torch.Tensor:
    """Positions in the whole sequence of rows ``first``.. of a query chunk."""
    start = query_chunk * half + first
    return torch.arange(start, start + count, device=device)


def _global_keys(key_chunks: tuple[int, int], seg: Segment, half: int,
                 device: torch.device) -> torch.Tensor:
    """Positions in the whole sequence of a segment's keys."""
    return torch.cat([torch.arange(key_chunks[i] * half, (key_chunks[i] + 1) * half,
                                   device=device) for i in seg.keys])


def _tiles(chunk: int, half: int) -> list[tuple[slice, int]]:
    """(rows of the local sequence, first row within the chunk) of each tile of query
    chunk ``chunk`` (0 or 1) of a local sequence of two chunks of ``half`` rows."""
    return [(slice(chunk * half + start, chunk * half + min(start + ROW_TILE, half)), start)
            for start in range(0, half, ROW_TILE)]


def _scores(q: torch.Tensor, k: torch.Tensor, seg: Segment, scale: float,
            first_row: int) -> torch.Tensor:
    """Scores of query rows ``first_row``.. of their chunk against a segment's keys."""
    s = (q @ k.transpose(-2, -1)) * scale
    if seg.diagonal:  # the last chunk of the keys is the query chunk itself
        c = k.shape[-2] // len(seg.keys)
        rows = torch.arange(first_row, first_row + q.shape[-2], device=q.device)
        later = rows[:, None] < torch.arange(c, device=q.device)[None, :]
        s[..., -c:] = s[..., -c:].masked_fill(later, float("-inf"))
    return s


def _expand(kv: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """Key/value heads in the working dtype, repeated for grouped-query attention (as
    Hugging Face's repeat_kv)."""
    kv = kv.to(dtype)
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           query_chunks: tuple[int, int], key_chunks: tuple[int, int], scale: float,
           dropout: AttentionDropout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of local queries ``q`` (B, H, L, D, in the working dtype) to one block
    of keys and values (B, Hkv, L, D, in the model's dtype): the block's output (B, H, L, D) and
    log-sum-exp (B, H, L); rows that see nothing of the block have output 0 and
    log-sum-exp -inf. ``dropout`` drops weights after the softmax (the log-sum-exp is
    the undropped one, so blocks merge as without it)."""
    groups = q.shape[1] // k.shape[1]
    half = q.shape[-2] // 2
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for i, seg in enumerate(segments(query_chunks, key_chunks)):
        if not seg.keys:
            continue
        kk = _expand(_take(k, seg.keys), groups, q.dtype)
        vv = _expand(_take(v, seg.keys), groups, q.dtype)
        key_positions = _global_keys(key_chunks, seg, half, q.device) if dropout else None
        for rows, first in _tiles(i, half):
            s = _scores(q[..., rows, :], kk, seg, scale, first)
            block_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - block_lse.unsqueeze(-1))
            if dropout is not None and key_positions is not None:
                p = p * dropout.scale(_global_rows(query_chunks[i], half, first,
                                                   p.shape[-2], q.device), key_positions,
                                      p.dtype)
            out[..., rows, :] = p @ vv
            lse[..., rows] = block_lse
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax over the union of two key sets from each one's output and log-sum-exp
    (``lse`` must be finite: the running result always holds the query's own chunk)."""
    new = torch.logaddexp(lse, block_lse)
    weight = torch.exp(block_lse - new).unsqueeze(-1)  # 0 where the block saw nothing
    return out * torch.exp(lse - new).unsqueeze(-1) + block_out * weight, new


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    query_chunks: tuple[int, int], key_chunks: tuple[int, int], scale: float,
                    lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor,
                    dropout: AttentionDropout | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block's share of the attention, given the merged log-sum-exp
    ``lse`` (B, H, L), the output's gradient ``dout`` and ``delta`` = rowsum(dout * out):
    (dq (B, H, L, D), dk and dv (B, Hkv, L, D)), in the working dtype. ``dropout``: the
    forward's, whose masks are drawn again (they are functions of positions)."""
    groups = q.shape[1] // k.shape[1]
    half = q.shape[-2] // 2
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape[0], q.shape[1], *k.shape[2:], dtype=q.dtype, device=q.device)
    dv = torch.zeros_like(dk)
    for i, seg in enumerate(segments(query_chunks, key_chunks)):
        if not seg.keys:
            continue
        kk = _expand(_take(k, seg.keys), groups, q.dtype)
        vv = _expand(_take(v, seg.keys), groups, q.dtype)
        dk_seg, dv_seg = torch.zeros_like(kk), torch.zeros_like(vv)
        key_positions = _global_keys(key_chunks, seg, half, q.device) if dropout else None
        for rows, first in _tiles(i, half):
            qi, doi = q[..., rows, :], dout[..., rows, :]
            p = torch.exp(_scores(qi, kk, seg, scale, first) - lse[..., rows].unsqueeze(-1))
            dp = doi @ vv.transpose(-2, -1)  # the gradient of the (dropped) weights
            kept = p
            if dropout is not None and key_positions is not None:
                factor = dropout.scale(_global_rows(query_chunks[i], half, first,
                                                    p.shape[-2], q.device), key_positions,
                                       p.dtype)
                dp, kept = dp * factor, p * factor
            ds = p * (dp - delta[..., rows].unsqueeze(-1)) * scale
            dq[..., rows, :] += ds @ kk
            dk_seg += ds.transpose(-2, -1) @ qi
            dv_seg += kept.transpose(-2, -1) @ doi
        for j, chunk in enumerate(seg.keys):
            keys = slice(chunk * half, (chunk + 1) * half)
            dk[..., keys, :] += dk_seg[..., j * half:(j + 1) * half, :]
            dv[..., keys, :] += dv_seg[..., j * half:(j + 1) * half, :]
    if groups > 1:  # sum the repeated heads back onto their key/value head
        dk = dk.view(k.shape[0], k.shape[1], groups, *k.shape[2:]).sum(2)
        dv = dv.view(k.shape[0], k.shape[1], groups, *k.shape[2:]).sum(2)
    return dq, dk, dv
