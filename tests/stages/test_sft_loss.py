"""The SFT loss of a real job (DeepSpeed ZeRO-3 engine, tiny Llama, one rank in this process) against a float64
loop over the rows on the same weights: the token mean of -log p over completion / assistant tokens only, the same
packed or padded, and the same however the rows are split into micro-batches."""
import json

import pytest
import torch

from verl_ds.config import load_config
from verl_ds.dist import detect_launch
from verl_ds.stages.sft import SFTJob

CHAT = [{"role": "user", "content": "even : 3 8"}, {"role": "assistant", "content": "2 4"},
        {"role": "user", "content": "odd : 1 5 7"}, {"role": "assistant", "content": "3 9"}]
ROWS = [{"messages": CHAT}, {"prompt": "even : 3 =>", "completion": " 2 4 6"}, {"prompt": "odd : 1 2 =>", "completion": " 5"},
        {"prompt": CHAT[:1], "completion": CHAT[1:2]}, {"messages": CHAT[:2]}, {"prompt": "even : 9 9 9 =>", "completion": " 8 8"},
        {"prompt": "odd :", "completion": " 1 3 5 7"}, {"prompt": "even : 0 =>", "completion": " 0"}]


def make_job(tmp_path, *overrides):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(None, [f"trainer.output_dir={tmp_path / 'run'}", f"data.train_files={path}",
                             "model.config_overrides.hidden_size=32", "model.config_overrides.intermediate_size=64", "actor.mini_batch_size=8",
                             "actor.micro_batch_size=4", "trainer.loggers=[plot]", "sft.max_completion_length=16",
                             *overrides])
    return SFTJob(cfg, detect_launch({}))


def reference_model(job):
    """The job's weights, gathered, in a plain float64 HF model."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from transformers import AutoModelForCausalLM

    module = job.engine.module
    model = AutoModelForCausalLM.from_config(module.config).double().eval()
    state = {}
    for name, p in module.named_parameters():
        with GatheredParameters([p], modifier_rank=None):
            state[name] = p.detach().to(torch.float64, copy=True)
    model.load_state_dict(state)
    return model


@torch.no_grad()
def loop_loss(model, items, completion_only: bool = True) -> float:
    """sum over rows and trained tokens of -log p(token | everything before it), over the number of such tokens;
    each row alone, unpadded (``completion_only=False``: every token after the first, as plain LM loss)."""
    total, count = 0.0, 0
    for x in items:
        seq = x["prompt_ids"] + x["response_ids"]
        log_probs = model(torch.tensor([seq])).logits[0].log_softmax(-1)
        trained = [0] * len(x["prompt_ids"]) + list(x["loss_mask"]) if completion_only else [1] * len(seq)
        for t in range(1, len(seq)):
            if trained[t]:
                total -= float(log_probs[t - 1, seq[t]])
                count += 1
    return total / count


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory):
    return tmp_path_factory.mktemp("sft_loss")


@pytest.mark.parametrize("remove_padding", [True, False])
def test_loss_is_the_completion_token_mean_of_a_float64_loop(tmp_path, remove_padding):
    job = make_job(tmp_path, f"model.remove_padding={str(remove_padding).lower()}")
    try:
        assert job.packed == remove_padding
        items = list(job.train_set)
        assert len(items) == len(ROWS)
        ref = reference_model(job)
        expected = loop_loss(ref, items)
        units = job.units(items)
        # by hand: 3 + 3 (two assistant turns), 4, 2, 3, 3, 3, 5, 2: each completion with its EOS
        assert units == sum(sum(x["loss_mask"]) for x in items) == 28
        whole, parts = job.loss(items, torch.tensor(float(units), dtype=torch.float64))
        assert float(whole.detach()) == pytest.approx(expected, rel=2e-6)
        assert float(parts["loss"]) / units == pytest.approx(expected, rel=2e-6)
        # the prompt / user tokens count for nothing: the plain LM loss over every token is another number
        assert abs(loop_loss(ref, items, completion_only=False) - expected) > 0.01
        # split into micro-batches of 1, 3 and 4 rows over the same normaliser: the shares add up to the same loss
        norm = torch.tensor(float(units), dtype=torch.float64)
        split = sum(float(job.loss(g, norm)[0]) for g in (items[:1], items[1:4], items[4:]))
        assert split == pytest.approx(expected, rel=2e-6)
    finally:
        job.close()


def test_gradient_of_one_step_is_the_float64_loops(tmp_path):
    """The engine's gradient of the LM head from the job's loss (backward as the spine runs it: the loss already
    normalised for the whole step, no division by the accumulation count) equals the float64 loop's gradient."""
    job = make_job(tmp_path, "deepspeed.zero_stage=0", "actor.grad_clip=0")
    try:
        items = list(job.train_set)
        ref = reference_model(job)
        units = job.units(items)
        loss, _ = job.loss(items, torch.tensor(float(units), dtype=torch.float64))
        job.engine.backward(loss, scale_wrt_gas=False)
        got = job.engine.module.lm_head.weight.grad.double()
        ref.zero_grad()
        with torch.enable_grad():
            total = 0.0
            for x in items:
                seq = x["prompt_ids"] + x["response_ids"]
                lp = ref(torch.tensor([seq])).logits[0].log_softmax(-1)
                trained = [0] * len(x["prompt_ids"]) + list(x["loss_mask"])
                total = total - sum(lp[t - 1, seq[t]] for t in range(1, len(seq)) if trained[t])
            (total / units).backward()
        want = ref.lm_head.weight.grad
        assert float((got - want).norm() / want.norm()) < 1e-5
    finally:
        job.close()
