"""One copy of a prompt for all the samples that answer it: pack a micro-batch with shared prompts.

With ``rollout.n`` samples per prompt, a micro-batch of whole groups holds each prompt n times. Every forward
over it (the update's, the reference's, the old log-probs') computes the same prompt hidden states n times:
they depend on the prompt tokens only (causal attention). ``pack_shared_prompts`` keeps one copy per distinct
prompt and puts the responses after it::

    [prompt A | response A1 | response A2 | ... | prompt B | response B1 | ...]

Positions restart at 0 for each prompt and continue from the prompt length in each of its responses, so every
token keeps the position it has in its own (prompt + response) sequence. A response token attends to its
prompt and to the earlier tokens of its own response only (``verl_ds.models.varlen_attention`` reads the layout
from the ``verl_ds_prompt_groups`` keyword), so each token's hidden state, log-prob and gradient are those of the
unshared packed row; the prompt's hidden states receive the gradient of all its responses, as the n copies'
gradients would add up. The saving is (n - 1) / n of the prompt tokens in every forward and backward. The
first response token of each sample is predicted by the shared last prompt token; a response's last token is
scored but not fed (its output would predict nothing), as in ``verl_ds.packing.pack(..., response_width=R)``. The same idea as "Prefix
Grouper" (Liu et al. 2025, https://arxiv.org/abs/2506.05433), for packed rows.

Response prefixes (``share_prefixes``, ``model.share_response_prefixes``): the same holds one level down. Samples of
a prompt that begin with the same response tokens (a converged policy's, short answers, a common opening) have the
same hidden states there too, so a group's responses are packed as a tree: its rows ordered by their responses, each
row holding only the tokens past the prefix it shares with the row before it, and each token attending to its
prompt, the shared tokens it continues (held by earlier rows of its group) and its own earlier tokens. A response
token then is scored once for all the samples that hold it after the same prefix (``ResponseIndex.take``); their
gradients add up as the copies' would. In a 30M-parameter GRPO run on the default task, the rows of the later steps
held 28-66% fewer response tokens.

Rows share a prompt when their prompt columns hold the same real tokens in the same places (the n copies of a prompt
in a rollout batch are padded alike), whatever their group ids say; a row whose prompt appears once is packed as in
``verl_ds.packing.pack``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from verl_ds.packing import PACK_NAMES, _no_prompt_rows, check_response_width, last_response_token
from verl_ds.rows import ResponseIndex, check_batch, index_responses, position_ids_from_mask, prompt_groups

__all__ = ["SharedPacked", "PromptGroups", "GroupBatch", "pack_shared_prompts", "PROMPT_GROUPS_KWARG"]

PROMPT_GROUPS_KWARG = "verl_ds_prompt_groups"


# a block holds consecutive groups up to this many tokens and is attended in one sdpa call with its block-diagonal
# mask: at most BLOCK_TOKENS x N attention scores for a row of N tokens, where one call per group costs more in
# dispatch than in arithmetic for groups of tens of tokens (a group over the cap is a block alone). Where the groups
# padded to one batch score fewer pairs still (G x L^2, e.g. 4 groups of 35 tokens: 4900 against 140^2 = 19600),
# the row may be attended that way instead, in one call (GroupBatch; the attention decides by the heads' width)
BLOCK_TOKENS = 256


@dataclass(frozen=True, eq=False)
class PromptGroups:
    """The layout ``verl_ds_varlen_sdpa`` reads: ``groups`` ((start, prompt_len, (response_len, ...)), ...), in
    packed order, each group's tokens contiguous, and two ways to attend them, each built on first use (on the host,
    then moved to ``device``) and kept for every layer of the forward:

    - ``blocks`` ((start, end, mask), ...): runs of consecutive groups up to ``BLOCK_TOKENS`` tokens, each attended
      in one call with its (1, 1, L, L) bool mask (each prompt causal on itself; each response sees its whole prompt
      and its own earlier tokens; nothing crosses groups);
    - ``batched`` (a ``GroupBatch``, or None where it would not score fewer pairs, ``saved_pairs`` <= 0): every
      group padded to the longest one and attended as one batch of groups.

    An object, not a tuple: DeepSpeed's ZeRO-3 module hooks walk every tuple and list in a forward's arguments, in
    every submodule."""

    groups: tuple
    device: torch.device | str = "cpu"

    @functools.cached_property
    def longest(self) -> int:
        """Tokens of the longest sequence in the row (a prompt and the fed tokens of one response, its shared leading
        ones counted): a sliding window at least this long changes nothing."""
        return max(p + max((len(link) + r for r, link in zip(lengths, links)), default=0)
                   for _, p, lengths, links in map(_parts, self.groups))

    @functools.cached_property
    def spans(self) -> tuple:
        """(start, end) of each block, without its mask."""
        return _block_spans(self.groups)

    @functools.cached_property
    def saved_pairs(self) -> int:
        """How many fewer attention scores per head ``batched`` computes than ``blocks`` (``_saved_pairs``)."""
        return _saved_pairs(self.groups, self.spans) if len(self.groups) > 1 else 0

    @functools.cached_property
    def blocks(self) -> tuple:
        grp, seg, depth, own = _token_layout(self.groups)
        index, first = torch.arange(seg.numel()), self.groups[0][0]
        out = []
        for start, end in self.spans:
            part = [t[start - first:end - first] for t in (grp, seg, depth, index)]
            mask = _visible(tuple(t[:, None] for t in part), tuple(t[None, :] for t in part), own)
            out.append((start, end, mask.view(1, 1, end - start, end - start).to(self.device)))
        return tuple(out)

    @functools.cached_property
    def batched(self) -> "GroupBatch | None":
        if not _batch_is_cheaper(self.groups, self.spans):
            return None
        return _group_batch(self.groups, self.device, self.saved_pairs)


@dataclass(frozen=True, eq=False)
class GroupBatch:
    """The groups of a packed row of N tokens as a batch of G groups of L (the longest group) slots.

    index: (G * L,) int64, the packed token in each slot (a pad slot repeats its group's first token); valid:
    (N,) int64, the slot of each packed token, in packed order; mask: (G, 1, L, L) bool, each group's mask on its
    real slots, and each pad slot's query seeing its group's first slot only (a row with nothing to attend would
    be NaN; pad outputs are dropped, so nothing flows back through them). saved_pairs: how many fewer attention
    scores per head than the blocks (the attention weighs it against the gathers' cost)."""

    index: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor
    saved_pairs: int = 0


def _parts(group) -> tuple:
    """(start, prompt_len, response lengths, links) of a layout entry; links: for each response, the responses (1-based
    in the group) that hold its shared leading tokens, one per depth (empty where it shares none)."""
    start, p, lengths = group[:3]
    return start, p, lengths, (group[3] if len(group) > 3 else ((),) * len(lengths))


def _token_layout(groups) -> tuple:
    """(group, segment, depth) of every token from the first group's start to the last one's end, each (n,) int64,
    and ``own``. Segments are numbered across the groups (a group's prompt, then its responses); depth: j for a
    response's j-th token (the first shared ones counted), -1 in a prompt; ``own`` (segments, D): own[s, d] the
    segment that holds the depth-d token that response segment s continues (s itself from its first own depth)."""
    lengths, owner_group, first_depth, is_prompt, links_at = [], [], [], [], []
    for g, group in enumerate(groups):
        _, p, responses, links = _parts(group)
        base = len(lengths)
        lengths += [p, *responses]
        owner_group += [g] * (len(responses) + 1)
        first_depth += [0] + [len(link) for link in links]
        is_prompt += [True] + [False] * len(responses)
        # response k of the group is segment base + 1 + k; its links name responses 1-based, i.e. segment base + link
        links_at += [(base + 1 + k, base + torch.tensor(link)) for k, link in enumerate(links) if link]
    lengths, first_depth = torch.tensor(lengths), torch.tensor(first_depth)
    segments = torch.arange(len(lengths))
    seg = torch.repeat_interleave(segments, lengths)
    starts = lengths.cumsum(0) - lengths
    offset = torch.arange(seg.numel()) - starts[seg]
    depth = torch.where(torch.tensor(is_prompt)[seg], -1, first_depth[seg] + offset)
    D = max(1, int(torch.where(torch.tensor(is_prompt), 0, first_depth + lengths).max()))  # the deepest response
    own = segments[:, None].expand(len(lengths), D).clone()
    for s, link in links_at:
        own[s, :link.numel()] = link
    return torch.tensor(owner_group)[seg], seg, depth, own


def _visible(q: tuple, k: tuple, own: torch.Tensor) -> torch.Tensor:
    """Bool "q may attend k" for query and key tokens given as broadcastable (group, segment, depth, index) tensors
    (``_token_layout``; index: a token's place in packed order): a prompt token sees the earlier tokens of its prompt;
    a response token sees its whole prompt and the tokens it continues, its own earlier ones and the shared prefix
    held by other responses of its group (at each depth below its own, the segment ``own`` names)."""
    qg, qs, qd, qi = q
    kg, ks, kd, ki = k
    # held[..., s, u]: key u is the token that segment s continues at u's depth; read at each query's segment (a bool
    # gather, not an int64 (Lq, Lk) lookup: a long group's mask is built on the host)
    held = (own[:, kd.clamp(min=0)] == ks).movedim(0, -2).squeeze(-3)  # (..., segments, Lk)
    continues = torch.gather(held, -2, qs.expand(*qs.shape[:-1], held.shape[-1]))
    ancestor = (qd >= 0) & (kd <= qd) & continues
    return (qg == kg) & (ki <= qi) & ((kd < 0) | ancestor)


def _block_spans(groups) -> tuple:
    """(start, end) of runs of consecutive groups of at most ``BLOCK_TOKENS`` tokens (a longer group alone)."""
    spans, start, size = [], None, 0
    for g_start, p, lengths, *_ in groups:
        n = p + sum(lengths)
        if start is not None and size + n > BLOCK_TOKENS:
            spans.append((start, start + size))
            start, size = None, 0
        if start is None:
            start = g_start
        size += n
    if start is not None:
        spans.append((start, start + size))
    return tuple(spans)


def _saved_pairs(groups, spans) -> int:
    """How many fewer scores per head attending ``groups`` as one padded batch computes than the blocks ``spans``
    ((start, end, ...) each) do: the sum of their squared lengths minus G x L^2, L the longest group."""
    longest = max(p + sum(lengths) for _, p, lengths, *_ in groups)
    return sum((span[1] - span[0]) ** 2 for span in spans) - len(groups) * longest ** 2


def _batch_is_cheaper(groups, spans) -> bool:
    """Whether attending ``groups`` as one padded batch scores fewer pairs than the blocks ``spans`` do; never for a
    row of one group."""
    return len(groups) > 1 and _saved_pairs(groups, spans) > 0


def _group_batch(groups, device, saved_pairs: int = 0) -> GroupBatch:
    """``groups`` as a ``GroupBatch`` (each padded to the longest), built on the host and moved to ``device`` once."""
    sizes = torch.tensor([p + sum(lengths) for _, p, lengths, *_ in groups])
    starts = torch.tensor([g[0] for g in groups])
    G, L = len(groups), int(sizes.max())
    slot = torch.arange(L)
    real = slot[None, :] < sizes[:, None]  # (G, L)
    index = torch.where(real, starts[:, None] + slot[None, :], starts[:, None])  # a pad slot: its group's first token
    grp, seg, depth, own = _token_layout(groups)
    local = index - starts[0]
    part = (grp[local], seg[local], depth[local], local)  # (G, L) each
    visible = _visible(tuple(t[:, :, None] for t in part), tuple(t[:, None, :] for t in part), own)
    mask = visible & real[:, :, None] & real[:, None, :]
    mask[:, :, 0] |= ~real  # a pad slot's query sees its group's first slot only
    valid = real.reshape(-1).nonzero().flatten()
    return GroupBatch(index=index.reshape(-1).to(device), valid=valid.to(device), mask=mask.unsqueeze(1).to(device),
                      saved_pairs=saved_pairs)


@dataclass(frozen=True)
class SharedPacked:
    """A padded (B, T) batch of prompt + response rows packed with one copy per distinct prompt.

    input_ids, position_ids: (1, N) int64. groups: the ``PromptGroups`` layout, groups in packed order, each
    group's responses right after its prompt, each without its last token (it predicts nothing; scoring reads it
    as a label only). targets: the ``ResponseIndex`` of every real response token (its id, the packed index of
    the token that predicts it, its place in the (B, R) response block), as ``Packed.targets``. shape: (B, T).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    groups: PromptGroups
    targets: ResponseIndex
    shape: tuple[int, int]
    response_width: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def attention_kwargs(self) -> dict:
        """The keyword ``verl_ds_varlen_sdpa`` reads the layout from (passed through the model's forward)."""
        return {PROMPT_GROUPS_KWARG: self.groups}


def pack_shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                        share_prefixes: bool = False) -> SharedPacked:
    """Pack ``input_ids`` (B, T), whose last ``response_width`` columns are the responses, with rows of identical
    prompts (the same real tokens in the same places of the first T - R columns) sharing one copy of it (see the
    module docstring). Groups come in the order of their first row, rows in batch order within a group.

    ``share_prefixes``: the responses of a prompt also share the leading tokens they have in common (the module
    docstring's response prefixes); a group's rows then come in the order of their responses (lexicographic, ties
    in batch order), so that each row's shared part is in the row before its own tokens."""
    input_ids, mask = check_batch(input_ids, attention_mask, "pack", PACK_NAMES)
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
    layout = PromptGroups(groups=tuple(groups), device=dev)  # its masks are built when the attention first asks
    return SharedPacked(input_ids=input_ids_packed.unsqueeze(0), position_ids=positions.unsqueeze(0), groups=layout,
                        targets=targets._replace(label_ids=labels, preds=preds, take=take), shape=(B, T),
                        response_width=R)
