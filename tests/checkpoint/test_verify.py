"""checkpoint.verify: "sizes", "edges" and "full" on real files; a bit flip in the middle of a large file is
found only by "full"; a manifest without full digests says so; the files are shared out over ranks evenly."""
import hashlib
import json
import os

import pytest

from verl_ds import checkpoint as ckpt


def _make(tmp_path, full=True):
    d = tmp_path / "global_step_3"
    (d / "actor" / "state").mkdir(parents=True)
    payload = os.urandom(5 * (1 << 20) + 123)  # > 2 MiB: its middle is in neither edge digest
    (d / "actor" / "state" / "shard.pt").write_bytes(payload)
    (d / "trainer_state.json").write_text("{}")
    files = ckpt._manifest(str(d))
    body = {"step": 3, "world_size": 1, "files": files,
            "digests": {rel: ckpt.edge_digest(str(d / rel)) for rel in files}}
    if full:
        body["sha256"] = {rel: hashlib.sha256((d / rel).read_bytes()).hexdigest() for rel in files}
    (d / ckpt.MANIFEST).write_text(json.dumps(body))
    return d, payload


def _flip_middle(d, payload):
    path = d / "actor" / "state" / "shard.pt"
    with open(path, "r+b") as fh:
        fh.seek(len(payload) // 2)
        fh.write(bytes([payload[len(payload) // 2] ^ 0x01]))


def test_full_finds_a_bit_flip_in_the_middle_that_edges_miss(tmp_path):
    d, payload = _make(tmp_path)
    assert [ckpt.verify(str(d), mode) for mode in ("sizes", "edges", "full")] == [None, None, None]
    _flip_middle(d, payload)
    assert ckpt.verify(str(d), "edges") is None  # the known blind spot of the cheap check
    assert ckpt.verify(str(d), "full") == ("file actor/state/shard.pt is corrupt (the sha256 of its bytes differs "
                                           "from the manifest's)")
    assert ckpt.verify_distributed(str(d), "full") == ckpt.verify(str(d), "full")


def test_full_needs_full_digests_and_bad_modes_are_named(tmp_path):
    d, _ = _make(tmp_path, full=False)
    assert ckpt.verify(str(d), "edges") is None
    assert "no full digest of actor/state/shard.pt (saved with digest='edges')" in ckpt.verify(str(d), "full")
    with pytest.raises(ValueError, match=r"verify mode: expected one of sizes, edges, full, got 'deep'"):
        ckpt.verify(str(d), "deep")
    assert ckpt.verify(str(d), digests=False) is None  # the older spelling of mode="sizes"


def test_full_digest_is_sha256_of_the_bytes(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(3 * ckpt._BLOCK + 5)  # several read blocks
    path.write_bytes(data)
    assert ckpt.full_digest(str(path)) == hashlib.sha256(data).hexdigest()


def test_files_are_shared_out_evenly_and_exactly_once():
    sizes = {f"f{i}": s for i, s in enumerate([900, 500, 400, 300, 300, 100, 100, 50])}
    shares = [ckpt._share(sizes, r, 3) for r in range(3)]
    assert sorted(sum(shares, [])) == sorted(sizes)
    loads = sorted(sum(sizes[f] for f in share) for share in shares)
    assert loads == [850, 900, 900]  # greedy largest-first: hand-computed
    assert ckpt._share(sizes, 0, 1) == sorted(sizes, key=lambda f: (-sizes[f], f))


def test_save_refuses_an_unknown_digest_and_an_empty_engine_map(tmp_path):
    with pytest.raises(ValueError, match=r"digest: expected 'edges' or 'full', got 'md5'"):
        ckpt.save(str(tmp_path), 1, {"actor": object()}, {}, keep_last=1, digest="md5")
    with pytest.raises(TypeError, match="engines: expected a non-empty mapping"):
        ckpt.save(str(tmp_path), 1, {}, {}, keep_last=1)
