"""On-policy distillation end to end (launch/train.py, real DeepSpeed ZeRO-3): a teacher made here (a tiny model after
a few SFT steps on the parity demonstrations, saved with save_pretrained) and a fresh student with no reward function:
the reverse KL to the teacher on the student's own samples falls, the teacher's log-prob of them rises and the
student's parity score (the task's rule, logged at weight 0) rises toward the teacher's. Then each bad teacher is
refused at start-up by name (exit 2)."""
import pytest
import torch

from e2e_utils import read_metrics, run_train
from verl_ds.config import ConfigError, load_config
from verl_ds.config.model_fields import TINY_MODEL
from verl_ds.run.startup import check_startup
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer

TINY = {**TINY_MODEL, "hidden_size": 32, "intermediate_size": 64}  # FAST's student shape
TEACHER_SFT_STEPS, SFT_BATCH = 30, 64  # about 0.9 parity score: far above a fresh student's ~0.35
DISTILL = ["reward.functions=[]", "algo.adv_estimator=reinforce_plus_plus", "actor.lr=1e-2",
           "trainer.total_steps=30", "trainer.val_every=0"]


def _tiny_lm(tok, seed: int, cls_name: str = "LlamaForCausalLM"):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                      bos_token_id=tok.bos_token_id, tie_word_embeddings=False, **TINY)
    return getattr(transformers, cls_name)(config)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A parity teacher: SFT (masked LM loss on the responses) of a tiny Llama on the task's demonstrations."""
    tok = build_tokenizer(parity.VOCAB)
    model = _tiny_lm(tok, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    demos = parity.demonstrations(tok, TEACHER_SFT_STEPS * SFT_BATCH, seed=3)
    for i in range(0, len(demos), SFT_BATCH):
        chunk = demos[i:i + SFT_BATCH]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in chunk])
        trained = torch.tensor([m + [0] * (width - len(m)) for _, m in chunk])
        attention = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in chunk])
        loss = model(input_ids=ids, attention_mask=attention, labels=ids.masked_fill(trained == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _quarters(rows: list, key: str) -> tuple[float, float]:
    q = max(1, len(rows) // 4)
    return sum(r[key] for r in rows[:q]) / q, sum(r[key] for r in rows[-q:]) / q


def test_a_student_with_no_reward_learns_from_the_teacher(tmp_path, teacher_dir):
    out = tmp_path / "run"
    run_train(str(out), [*DISTILL, f"distill.teacher_path={teacher_dir}"])
    rows = [m for m in read_metrics(str(out)) if "distill/reverse_kl" in m]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all("timing_s/teacher" in r and r["rollout/score/mean"] == 0.0 for r in rows)  # no reward trains it
    kl0, kl1 = _quarters(rows, "distill/reverse_kl")
    lp0, lp1 = _quarters(rows, "distill/teacher_logprob")
    s0, s1 = _quarters(rows, "reward/parity/mean")
    assert kl1 < 0.6 * kl0, (kl0, kl1)  # measured: 1.40 -> 0.48
    assert lp1 > lp0 + 0.8, (lp0, lp1)  # -4.1 -> -2.5: the samples are what the teacher would write
    assert s1 > s0 + 0.1, (s0, s1)  # 0.40 -> 0.58, toward the teacher's ~0.9


def _cfg(tmp_path, *overrides):
    return load_config(overrides=[f"trainer.output_dir={tmp_path / 'out'}", "reward.functions=[]", *overrides])


def test_bad_teachers_are_refused_at_start_up_by_name(tmp_path, teacher_dir):
    with pytest.raises(ConfigError, match="distill.teacher_path: .* does not exist"):
        check_startup(_cfg(tmp_path, f"distill.teacher_path={tmp_path / 'missing'}"))
    with pytest.raises(ConfigError, match=r"distill.teacher_path=base .* needs actor.lora_rank > 0"):
        check_startup(_cfg(tmp_path, "distill.teacher_path=base"))
    tok = build_tokenizer(parity.VOCAB)
    scorer = tmp_path / "reward_model"  # a Llama, but a sequence classifier
    _tiny_lm(tok, seed=1, cls_name="LlamaForSequenceClassification").save_pretrained(scorer)
    tok.save_pretrained(scorer)
    with pytest.raises(ConfigError, match=r"is not a causal LM \(architectures \['LlamaForSequenceClassification'\]"):
        check_startup(_cfg(tmp_path, f"distill.teacher_path={scorer}"))
    other = tmp_path / "other_vocab"  # the same shape, another vocabulary
    other_tok = build_tokenizer([*parity.VOCAB[:-1], "->"])
    _tiny_lm(other_tok, seed=1).save_pretrained(other)
    other_tok.save_pretrained(other)
    with pytest.raises(ConfigError, match=r"vocabulary \(18 tokens\) differs from the actor's \(18 tokens\), "
                                          "e.g. id 17 is '->' to the teacher and '=>' to the actor"):
        check_startup(_cfg(tmp_path, f"distill.teacher_path={other}"))
    bare = tmp_path / "no_tokenizer"
    _tiny_lm(tok, seed=1).save_pretrained(bare)
    with pytest.raises(ConfigError, match="has no usable tokenizer .* save the tokenizer with the teacher"):
        check_startup(_cfg(tmp_path, f"distill.teacher_path={bare}"))
    with pytest.raises(ConfigError, match="configure at least one of reward.functions or reward.model_path"):
        check_startup(_cfg(tmp_path))  # no reward and no teacher: nothing would train the actor
    check_startup(_cfg(tmp_path, f"distill.teacher_path={teacher_dir}"))  # the good teacher passes

    # the command line: exit 2 with the message, before any model is built
    proc = run_train(str(tmp_path / "cli"), [*DISTILL, f"distill.teacher_path={other}"], check=False)
    assert proc.returncode == 2 and "distill.teacher_path: the teacher's vocabulary" in proc.stderr, proc.stderr[-2000:]


def test_the_lora_actors_base_as_teacher_starts_at_zero_kl(tmp_path):
    """``base``: the actor's own base, adapters off; LoRA's B starts at 0, so at step 1 the student is its teacher,
    and the base, being the reference too, is scored once for both."""
    pytest.importorskip("peft")
    out = tmp_path / "run"
    run_train(str(out), ["distill.teacher_path=base", "distill.mode=reward", "actor.lora_rank=4", "actor.lora_alpha=8",
                         "algo.adv_estimator=reinforce_plus_plus", "trainer.val_every=0"])
    rows = [m for m in read_metrics(str(out)) if "distill/reverse_kl" in m]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["distill/reverse_kl"] == 0.0
    assert rows[0]["reward/parity/mean"] == pytest.approx(rows[0]["rollout/score/mean"], abs=1e-6)  # a task reward too
