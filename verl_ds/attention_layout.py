"""Who may attend to whom in a packed row, one rule for every layout, and which kernel serves it. A row is cut into
segments, each with a parent: ``may_attend(q, kv) = kv <= q and segment(kv) is an ancestor-or-self of segment(q) and
position(q) - position(kv) < window``, which is each sequence run alone (docs/models.md, "Attention")."""
from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["AttentionLayout", "LAYOUT_KWARG", "usable_implementations",
           "resolve_attn_implementation", "packed_attention"]

LAYOUT_KWARG = "verl_ds_attention_layout"  # the forward keyword that carries a row's layout to every attention call


@dataclass(frozen=True, eq=False)
class AttentionLayout:
    """Segments of a packed row: ``starts`` (then the row's end), ``parents`` (-1: a root), ``first_pos``. An object,
    not a tuple: DeepSpeed's ZeRO-3 module hooks walk every tuple and list in a forward's arguments."""

    starts: tuple
    parents: tuple
    first_pos: tuple
    device: torch.device | str = "cpu"
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_runs(cls, runs, device="cpu") -> "AttentionLayout":
        """From (start, length, parent token or -1, first position) runs in packed order; a run's parent token lies in
        an earlier run of its tree. A segment is cut after every token another continues, so parents lie on paths."""
        runs = [r for r in runs if r[1] > 0]
        if not runs:
            raise ValueError("AttentionLayout: a packed row needs at least one token")
        end = runs[-1][0] + runs[-1][1]
        opens = {start: (parent, pos) for start, _, parent, pos in runs}
        cuts = set(opens) | {parent + 1 for _, _, parent, _ in runs if parent >= 0}
        starts = sorted(c for c in cuts if c < end)
        parents, first_pos = [], []
        for s, start in enumerate(starts):
            if start in opens:
                parent, pos = opens[start]
                parents.append(bisect.bisect_right(starts, parent) - 1 if parent >= 0 else -1)
                first_pos.append(pos)
            else:  # a cut inside a run: its tokens continue the previous segment's last one
                parents.append(s - 1)
                first_pos.append(first_pos[-1] + start - starts[s - 1])
            if parents[-1] >= s:
                raise ValueError(f"AttentionLayout: the run at token {start} continues token {opens[start][0]}, "
                                 f"which is not before it")
        layout = cls(starts=tuple(starts) + (end,), parents=tuple(parents), first_pos=tuple(first_pos), device=device)
        layout.trees  # noqa: B018 - refuses a tree that is not contiguous now, not in the first layer
        return layout

    @classmethod
    def sequences(cls, lengths, device="cpu") -> "AttentionLayout":
        """Plain packing: one root segment per sequence of ``lengths`` tokens (positions from 0)."""
        starts = [0, *itertools.accumulate(int(n) for n in lengths)]
        return cls.from_runs([(s, e - s, -1, 0) for s, e in zip(starts, starts[1:])], device)

    @functools.cached_property
    def trees(self) -> tuple:
        """(start, end, segments) of each tree (a root and its descendants), in packed order."""
        out, roots = [], [s for s, p in enumerate(self.parents) if p < 0]
        for i, root in enumerate(roots):
            last = roots[i + 1] if i + 1 < len(roots) else len(self.parents)
            if any(not root <= self.parents[s] < last for s in range(root + 1, last)):
                raise ValueError(f"AttentionLayout: the tree from token {self.starts[root]} is not contiguous")
            out.append((self.starts[root], self.starts[last], last - root))
        return tuple(out)

    @functools.cached_property
    def tensors(self) -> tuple:
        """(segment (N,), position (N,), ancestry (S, S) bool or None: [s, u] when u is s or an ancestor)."""
        starts = torch.tensor(self.starts)
        lengths = starts[1:] - starts[:-1]
        seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        pos = torch.tensor(self.first_pos)[seg] + torch.arange(seg.numel()) - starts[:-1][seg]
        anc = None
        if any(p >= 0 for p in self.parents):  # else plain packing: the identity
            S = len(self.parents)
            anc = torch.eye(S, dtype=torch.bool)
            for s, p in enumerate(self.parents):  # parents come first: their rows are complete
                if p >= 0:
                    anc[s] |= anc[p]
            anc = anc.to(self.device)
        return seg.to(self.device), pos.to(self.device), anc

    def may_attend(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
        """The module docstring's rule on broadcastable packed indices (also FlexAttention's mask_mod body)."""
        seg, pos, anc = self.tensors
        related = seg[q_idx] == seg[kv_idx] if anc is None else anc[seg[q_idx], seg[kv_idx]]
        ok = (kv_idx <= q_idx) & related
        if window:
            ok = ok & (pos[q_idx] - pos[kv_idx] < window)
        return ok

    def dense(self, start: int, end: int, window: Optional[int] = None) -> torch.Tensor:
        """``may_attend`` on the grid of tokens [start, end): (end - start, end - start) bool, cached."""
        key = ("dense", start, end, window)
        if key not in self._cache:
            idx = torch.arange(start, end, device=self.device)
            self._cache[key] = self.may_attend(idx[:, None], idx[None, :], window)
        return self._cache[key]

    def branches(self, tree: int, window: Optional[int] = None, min_saved: float = 0) -> Optional[tuple]:
        """Tree ``tree`` for sdpa without its dense (L, L) grid: (root_end, q_idx (m, Q), kv_idx (m, K), mask (m, Q, K),
        rows). The root attends alone; each other segment's queries attend its path in one batched call; ``rows`` picks
        the real rows of the (m * Q) outputs. None when it saves under ``min_saved`` of the L^2 score entries."""
        key = ("branches", tree, window, min_saved)
        if key not in self._cache:
            self._cache[key] = self._branches(tree, window, min_saved)
        return self._cache[key]

    def _branches(self, tree: int, window: Optional[int], min_saved: float) -> Optional[tuple]:
        start, end, count = self.trees[tree]
        root = bisect.bisect_left(self.starts, start)
        if count < 2:
            return None
        lengths = [self.starts[s + 1] - self.starts[s] for s in range(root, root + count)]
        depth_tokens = list(lengths)  # tokens on each segment's path
        for s in range(root + 1, root + count):
            depth_tokens[s - root] += depth_tokens[self.parents[s] - root]
        Q, K = max(lengths[1:]), max(depth_tokens[1:])
        if (end - start) ** 2 - (lengths[0] ** 2 + (count - 1) * Q * K) < max(min_saved, 1):
            return None
        spans = [range(self.starts[s], self.starts[s + 1]) for s in range(root, root + count)]
        paths = [list(spans[0])]  # a parent comes before its children: its path is complete when they extend it
        for s in range(root + 1, root + count):
            paths.append(paths[self.parents[s] - root] + list(spans[s - root]))
        spans, paths = spans[1:], paths[1:]
        q_idx = torch.tensor([list(r) + [r[-1]] * (Q - len(r)) for r in spans])
        kv_idx = torch.tensor([p + [p[0]] * (K - len(p)) for p in paths])
        kv_real = torch.arange(K)[None, :] < torch.tensor([len(p) for p in paths])[:, None]
        rows = torch.cat([torch.arange(len(r)) + i * Q for i, r in enumerate(spans)])
        q_idx, kv_idx = q_idx.to(self.device), kv_idx.to(self.device)
        mask = self.may_attend(q_idx[:, :, None], kv_idx[:, None, :], window) & kv_real.to(self.device)[:, None, :]
        return self.starts[root + 1], q_idx, kv_idx, mask, rows.to(self.device)

    def block_mask(self, window: Optional[int] = None):
        """FlexAttention's ``BlockMask`` of ``may_attend`` over the whole row, cached (one per window)."""
        key = ("block", window)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            n = self.starts[-1]
            # compiled on CUDA: the mask is built block by block, never as an (N, N) tensor
            self._cache[key] = create_block_mask(lambda b, h, q, kv: self.may_attend(q, kv, window), None, None, n, n,
                                                 device=self.device, _compile=torch.device(self.device).type == "cuda")
        return self._cache[key]


def usable_implementations(device_type: str) -> dict:
    """Each explicit ``model.attn_implementation`` -> None when it can train on ``device_type`` here, else why not."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    cuda = device_type == "cuda"
    return {"sdpa": None, "eager": None,
            # torch 2.13: "FlexAttention does not support backward on CPU"
            "flex_attention": None if cuda else "no backward on the CPU (torch's FlexAttention)",
            "flash_attention_2": None if cuda and is_flash_attn_2_available() else (
                "the flash-attn package is not installed" if cuda else "needs CUDA"),
            "flash_attention_3": None if cuda and is_flash_attn_3_available() else (
                "flash-attn 3 (flash_attn_interface) is not installed" if cuda else "needs CUDA")}


def resolve_attn_implementation(name: str, device_type: str) -> str:
    """``model.attn_implementation`` on ``device_type``: ``auto`` is flash_attention_2 on CUDA with flash-attn, else
    flex_attention on CUDA, else sdpa; an explicit name must be usable (ValueError naming those that are)."""
    usable = usable_implementations(device_type)
    if name == "auto":
        return next(n for n in ("flash_attention_2", "flex_attention", "sdpa") if usable[n] is None)
    ok = ", ".join(["auto"] + [n for n, why in usable.items() if why is None])
    if name not in usable:
        raise ValueError(f"{name!r} is not an attention implementation verl_ds can train with; usable on "
                         f"{device_type}: {ok}")
    if usable[name] is not None:
        raise ValueError(f"{name!r} cannot train on {device_type}: {usable[name]}; usable here: {ok}")
    return name


def packed_attention(implementation: str, shared: bool, device_type: str) -> tuple:
    """(attention for packed rows, a start-up note or None): flash-attention serves plain packing but not a tree, which
    FlexAttention serves; sdpa and eager serve every layout one tree at a time, slow on a GPU."""
    if implementation.startswith("flash_attention"):
        if not shared:
            return implementation, None
        return "verl_ds_varlen_flex", (f"{implementation} cannot serve shared prompts / response prefixes (a tree "
                                       f"mask): flex_attention serves the packed rows")
    if implementation == "flex_attention":
        return "verl_ds_varlen_flex", None
    note = None if device_type != "cuda" else (f"{implementation}: packed rows take one sdpa call per sequence or "
                                               f"prompt group per layer, slow on a GPU (flex_attention: one call)")
    return "verl_ds_varlen_sdpa", note
