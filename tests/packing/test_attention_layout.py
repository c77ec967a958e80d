"""The one definition of who may attend to whom (``verl_ds.attention_layout``) against hand-drawn masks, and the
choice of attention implementation (``model.attn_implementation``): ``auto`` on this machine, explicit names, and
the refusal of one that cannot train here, at start-up with the key named."""
import os
import subprocess
import sys

import pytest
import torch

from verl_ds.attention_layout import AttentionLayout, packed_attention, resolve_attn_implementation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _grid(layout, window=None):
    idx = torch.arange(layout.starts[-1])
    return layout.may_attend(idx[:, None], idx[None, :], window).int().tolist()


def test_a_prefix_tree_by_hand():
    """Prompt [0, 1] with three responses: A = own tokens 2, 3; B shares A's token 2 and owns 4; C owns 5 (no shared
    token). Then a second sequence of one token (6). A's token 3 is cut into its own segment (B branches off after
    token 2)."""
    layout = AttentionLayout.from_runs([(0, 2, -1, 0), (2, 2, 1, 2), (4, 1, 2, 3), (5, 1, 1, 2), (6, 1, -1, 0)])
    assert layout.starts == (0, 2, 3, 4, 5, 6, 7) and layout.parents == (-1, 0, 1, 1, 0, -1)
    assert layout.first_pos == (0, 2, 3, 3, 2, 0)
    assert layout.trees == ((0, 6, 5), (6, 7, 1))
    want = [[1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],  # A's first token
            [1, 1, 1, 1, 0, 0, 0],  # A's second
            [1, 1, 1, 0, 1, 0, 0],  # B: the prompt, A's first token (shared), itself; not A's second
            [1, 1, 0, 0, 0, 1, 0],  # C: the prompt and itself
            [0, 0, 0, 0, 0, 0, 1]]  # the second sequence
    assert _grid(layout) == want
    assert layout.dense(0, 6).int().tolist() == [row[:6] for row in want[:6]]
    # a window of 2 (positions: 0 1 2 3 3 2 0): each token sees itself and the one before it on its path
    assert _grid(layout, 2) == [[1, 0, 0, 0, 0, 0, 0],
                                [1, 1, 0, 0, 0, 0, 0],
                                [0, 1, 1, 0, 0, 0, 0],
                                [0, 0, 1, 1, 0, 0, 0],
                                [0, 0, 1, 0, 1, 0, 0],
                                [0, 1, 0, 0, 0, 1, 0],
                                [0, 0, 0, 0, 0, 0, 1]]


def test_branches_by_hand():
    """Prompt [0, 1, 2] with responses of 6, 5 and 7 own tokens: its dense grid is 21 x 21 = 441 score entries, the
    branch plan 3 x 3 (the prompt) + 3 x 7 x 10 (each response padded to 7 queries on its path padded to 10 keys) =
    219, so it saves 222 entries: taken when at least that many are asked for. The tree of the first test saves
    36 - (4 + 4 x 1 x 4) = 16; a single sequence has no plan."""
    layout = AttentionLayout.from_runs([(0, 3, -1, 0), (3, 6, 2, 3), (9, 5, 2, 3), (14, 7, 2, 3)])
    assert layout.branches(0, min_saved=223) is None and layout.branches(0, min_saved=222) is not None
    root_end, q_idx, kv_idx, mask, rows = layout.branches(0)
    assert root_end == 3
    assert q_idx.tolist() == [[3, 4, 5, 6, 7, 8, 8], [9, 10, 11, 12, 13, 13, 13], [14, 15, 16, 17, 18, 19, 20]]
    assert kv_idx.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 0], [0, 1, 2, 9, 10, 11, 12, 13, 0, 0],
                               [0, 1, 2, 14, 15, 16, 17, 18, 19, 20]]
    # response k's i-th query: the prompt and its own first i + 1 tokens; a repeated query row repeats its mask row
    want = [[[1] * (3 + min(i, n - 1) + 1) + [0] * (10 - 3 - min(i, n - 1) - 1) for i in range(7)] for n in (6, 5, 7)]
    assert mask.int().tolist() == want
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 14, 15, 16, 17, 18, 19, 20]
    # a window of 2 (positions 3.. in each response): the first response token sees the prompt's last and itself
    assert layout.branches(0, 2)[3][0, 0].int().tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
    small = AttentionLayout.from_runs([(0, 2, -1, 0), (2, 2, 1, 2), (4, 1, 2, 3), (5, 1, 1, 2), (6, 1, -1, 0)])
    assert small.branches(0, min_saved=17) is None and small.branches(0, min_saved=16) is not None
    assert small.branches(1) is None  # one token, one segment


def test_plain_packing_is_block_diagonal_and_causal():
    layout = AttentionLayout.sequences([3, 1, 2])
    assert layout.tensors[2] is None  # no ancestry table: the same segment is the whole rule
    want = torch.zeros(6, 6, dtype=torch.int)
    for s, e in ((0, 3), (3, 4), (4, 6)):
        want[s:e, s:e] = torch.tril(torch.ones(e - s, e - s, dtype=torch.int))
    assert _grid(layout) == want.tolist()


def test_the_block_mask_is_the_definition():
    """FlexAttention's BlockMask, densified, equals ``may_attend`` on the grid (with and without a window)."""
    layout = AttentionLayout.from_runs([(0, 2, -1, 0), (2, 2, 1, 2), (4, 1, 2, 3), (5, 1, 1, 2), (6, 1, -1, 0)])
    for window in (None, 2):
        dense = layout.block_mask(window).to_dense()  # (1, 1, blocks, blocks): one 128-token block here
        assert dense.shape[-1] == 1 and bool(dense.all())
        assert layout.block_mask(window) is layout.block_mask(window)  # built once, kept for every layer
    bm = layout.block_mask(2)
    idx = torch.arange(7)
    assert bm.mask_mod(0, 0, idx[:, None], idx[None, :]).int().tolist() == _grid(layout, 2)


def test_bad_runs_are_refused():
    with pytest.raises(ValueError, match="continues token 5, which is not before it"):
        AttentionLayout.from_runs([(0, 2, -1, 0), (2, 2, 5, 2), (4, 2, -1, 0)])
    with pytest.raises(ValueError, match="the tree from token 2 is not contiguous"):
        AttentionLayout.from_runs([(0, 2, -1, 0), (2, 1, -1, 0), (3, 1, 1, 2)])
    with pytest.raises(ValueError, match="needs at least one token"):
        AttentionLayout.from_runs([(0, 0, -1, 0)])


def test_the_implementation_auto_picks_and_explicit_names():
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    with pytest.raises(ValueError, match=r"'flash_attention_2' cannot train on cpu: needs CUDA; usable here: auto, "
                                         r"sdpa, eager"):
        resolve_attn_implementation("flash_attention_2", "cpu")
    with pytest.raises(ValueError, match=r"'flex_attention' cannot train on cpu: no backward on the CPU"):
        resolve_attn_implementation("flex_attention", "cpu")
    with pytest.raises(ValueError, match=r"'paged_attention' is not an attention implementation"):
        resolve_attn_implementation("paged_attention", "cpu")
    # which function serves the packed rows, and when the run says so
    assert packed_attention("flash_attention_2", False, "cuda") == ("flash_attention_2", None)
    name, note = packed_attention("flash_attention_2", True, "cuda")
    assert name == "verl_ds_varlen_flex" and "cannot serve shared prompts" in note
    assert packed_attention("flex_attention", True, "cuda") == ("verl_ds_varlen_flex", None)
    assert packed_attention("sdpa", True, "cpu") == ("verl_ds_varlen_sdpa", None)
    assert "slow on a GPU" in packed_attention("sdpa", False, "cuda")[1]
    assert packed_attention("eager", False, "cpu")[0] == "verl_ds_varlen_sdpa"


@pytest.mark.parametrize("value, said", [
    ("flash_attention_2", "model.attn_implementation: 'flash_attention_2' cannot train on cpu: needs CUDA"),
    ("magic", "model.attn_implementation"),
])
def test_an_unusable_implementation_exits_2_naming_the_key(tmp_path, value, said):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"),
                           f"trainer.output_dir={tmp_path / 'run'}", f"model.attn_implementation={value}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert said in proc.stderr + proc.stdout
