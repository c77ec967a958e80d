"""One copy of a prompt for all its samples in a packed row, ``[prompt A | A1 | A2 | ... | prompt B | B1 | ...]``,
optionally with shared response prefixes packed as a tree; the same log-probs and gradients as the unshared rows
(as "Prefix Grouper", Liu et al. 2025, https://arxiv.org/abs/2506.05433). Design: docs/models.md, "Packed rows"."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_ds.attention_layout import LAYOUT_KWARG, AttentionLayout
from verl_ds.packing import PACK_NAMES, _no_prompt_rows, check_response_width, last_response_token
from verl_ds.rows import ResponseIndex, check_ids_and_mask, index_responses, position_ids_from_mask, prompt_groups

__all__ = ["SharedPacked", "group_layout", "pack_shared_prompts"]


def group_layout(groups, device="cpu") -> AttentionLayout:
    """The ``AttentionLayout`` of ``groups`` ((start, prompt_len, (response_len, ...)[, links]), ...), where links name,
    per response, the responses (1-based in the group) holding its shared leading tokens, one per depth: each
    response's own tokens continue its prompt or the shared token before them, at their own sequence's positions."""
    runs = []
    for start, p, lengths, *rest in groups:
        links = rest[0] if rest else ((),) * len(lengths)
        own = [start + p + sum(lengths[:k]) for k in range(len(lengths))]  # each response's first own token
        runs.append((start, p, -1, 0))
        for k, (r, link) in enumerate(zip(lengths, links)):
            m = len(link)  # the depth of its first own token
            if m == 0:
                parent = start + p - 1
            else:  # the depth m - 1 token, held by response link[m - 1] at its own depth m - 1
                h = link[m - 1] - 1
                parent = own[h] + m - 1 - len(links[h])
            runs.append((own[k], r, parent, p + m))
    return AttentionLayout.from_runs(runs, device)


@dataclass(frozen=True)
class SharedPacked:
    """A padded (B, T) batch packed with one copy per prompt: input_ids, position_ids (1, N); group_layout's groups."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    groups: tuple
    layout: AttentionLayout
    targets: ResponseIndex
    shape: tuple[int, int]
    response_width: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def attention_kwargs(self) -> dict:
        """The keyword the attention functions read the layout from, passed through the model's forward."""
        return {LAYOUT_KWARG: self.layout}


def pack_shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                        share_prefixes: bool = False) -> SharedPacked:
    """Pack ``input_ids`` (B, T), whose last ``response_width`` columns are responses, one copy per distinct prompt."""
    input_ids, mask = check_ids_and_mask(input_ids, attention_mask, "pack", PACK_NAMES)
    B, T = input_ids.shape
    R = check_response_width(response_width, T)
    _no_prompt_rows(mask, R)
    P, dev = T - R, input_ids.device
    ids, rows = input_ids.long(), torch.arange(B, device=dev)
    plen, rlen = mask[:, :P].sum(1), mask[:, P:].sum(1)
    group = prompt_groups(ids, mask, P)[0]
    fed = mask & ~last_response_token(mask, R)  # a response's last token predicts nothing: a label only
    # prefixes are compared column by column: only responses that start at column P (a rollout's) take part
    share_prefixes = share_prefixes and not bool((mask[:, P + 1:] & ~mask[:, P:-1]).any())
    fed_ids = torch.where(fed[:, P:], ids[:, P:], -1)  # (B, R), the fed tokens left-aligned (responses start at P)
    if share_prefixes:  # rows of a group ordered by their responses: a row's longest shared prefix is its predecessor's
        _, rank = torch.unique(torch.cat([group[:, None], fed_ids], 1), dim=0, return_inverse=True)
        order = torch.argsort(rank * B + rows)
    else:
        order = torch.argsort(group * B + rows)  # groups in turn, rows in batch order within one
    sorted_group = group[order]
    opens = torch.ones(B, dtype=torch.bool, device=dev)  # the first row of its group in `order`
    opens[1:] = sorted_group[1:] != sorted_group[:-1]
    lead_of = order[opens]  # each group's lead row (groups are numbered in order)
    leads = torch.zeros(B, dtype=torch.bool, device=dev).index_fill_(0, lead_of, True)  # brings its group's prompt
    # shared[row]: how many of its leading fed tokens the rows before it in its group already hold
    shared = torch.zeros(B, dtype=torch.long, device=dev)
    if share_prefixes and B > 1:
        fo = fed_ids[order]
        same = ((fo[1:] == fo[:-1]) & (fo[1:] >= 0)).long().cumprod(1).sum(1)
        shared[order[1:]] = torch.where(opens[1:], 0, same)
    cols = torch.arange(T, device=dev)
    depth = (cols - P)[None, :]  # a response column's index in its response
    # what goes in the row: the lead's prompt and every fed response token past the shared part
    emit = (fed & (cols >= P)[None, :] & (depth >= shared[:, None])) | (mask & (cols < P)[None, :] & leads[:, None])
    sel = emit[order].reshape(-1)
    src_rows = order.repeat_interleave(T)[sel]  # each packed token's row and column in the padded batch
    src_cols = cols.repeat(B)[sel]
    input_ids_packed = ids[src_rows, src_cols]
    rank = position_ids_from_mask(mask)  # a token's place in its own prompt + response
    positions = rank[src_rows, src_cols]
    counts = emit[order].sum(1)
    row_start = torch.empty_like(counts).scatter_(0, order, counts.cumsum(0) - counts)  # by row
    response_start = row_start + torch.where(leads, plen, 0)  # where a row's own response tokens begin in the row
    # node[row, d]: the packed index of the depth-d fed token of the row's response, its own or the shared one,
    # held by the last row up to it in `order` that does not share depth d with its predecessor
    k = torch.arange(B, device=dev)[:, None]
    holder_pos = torch.where(shared[order][:, None] <= torch.arange(R, device=dev)[None, :], k, -1).cummax(0).values
    holder = order[holder_pos]  # (B, R) in `order`
    node = torch.empty((B, R), dtype=torch.long, device=dev)
    node[order] = response_start[holder] + torch.arange(R, device=dev)[None, :] - shared[holder]
    # where the packed row holds each token of a row's sequence: its group's prompt, then its response's nodes
    place = torch.where(cols[None, :] < P, row_start[lead_of[group]][:, None] + rank,
                        node.gather(1, (rank - plen[:, None]).clamp(0, R - 1)))
    targets = index_responses(ids, mask, R, place, order)
    preds, labels = targets.preds, targets.label_ids
    take = None
    if share_prefixes and bool((shared > 0).any()):  # the same (predictor, token) pair scored once
        V = int(labels.max()) + 1
        pairs, take = torch.unique(preds * V + labels, return_inverse=True)
        preds, labels = pairs // V, pairs % V
    rfed = (rlen - 1).clamp(min=0) - shared  # each row's own response tokens in the row
    # the attention layout: one (start, prompt_len, response lengths[, links]) per group, read from the host at once
    host = torch.stack([sorted_group, row_start[order], plen[order], rfed[order], shared[order]]).T.tolist()
    holders = (holder_pos - torch.nonzero(opens).flatten()[sorted_group][:, None] + 1).tolist()  # 1-based in group
    groups: list = []
    for pos, (g, start, p, r, m) in enumerate(host):
        if len(groups) == g:
            groups.append((start, p, [], []))
        groups[g][2].append(r)
        groups[g][3].append(tuple(holders[pos][:m]))
    groups = [(start, p, tuple(lengths)) + ((tuple(links),) if any(links) else ())
              for start, p, lengths, links in groups]
    groups = tuple(groups)
    return SharedPacked(input_ids=input_ids_packed.unsqueeze(0), position_ids=positions.unsqueeze(0), groups=groups,
                        layout=group_layout(groups, dev),
                        targets=targets._replace(label_ids=labels, preds=preds, take=take), shape=(B, T),
                        response_width=R)
