"""Build a real Trainer (world size 1, DeepSpeed ZeRO-3 engines) and look inside it; run by
test_startup_checks.py in a subprocess (DeepSpeed initialises torch.distributed once per process).

    python probe_trainer.py <result.json> <bad_rewards.py> key.sub=value ...

Writes {"pad_eos": ..., "dropout": ..., "reward_errors": {...}, "step": ...} to result.json.
"""
import json
import sys
import traceback

import torch


def main(result_path: str, rewards_file: str, overrides: list) -> None:
    from verl_ds.batch import RolloutBatch
    from verl_ds.builder import build_reward
    from verl_ds.config import load_config
    from verl_ds.data import collate_prompts
    from verl_ds.dist import detect_launch
    from verl_ds.trainer import Trainer

    out = {}
    trainer = Trainer(load_config(None, overrides), detect_launch())
    tok = trainer.tokenizer
    out["pad_is_eos"] = tok.pad_token_id == tok.eos_token_id

    # pad == eos: the trainer's own rollout and batch; the EOS a response ends with is inside its mask
    prompts = collate_prompts([trainer.c.train_set[i] for i in range(8)], tok.pad_token_id)
    rows = []
    for _ in range(6):
        gen = trainer.registry.get("actor").rollout_engine.generate(prompts["input_ids"], prompts["attention_mask"],
                                                                    max_new_tokens=12, temperature=1.0)
        batch = RolloutBatch.from_generation(prompts["input_ids"], prompts["attention_mask"], gen.responses,
                                             gen.response_length, gen.done, pad_token_id=tok.pad_token_id)
        batch.validate(tok.pad_token_id, required=())
        for i in range(len(batch)):
            n = int(batch.response_length[i])
            rows.append({"done": bool(gen.done[i]), "length": n, "width": batch.response_width,
                         "last_token_is_eos": int(batch.action[i, n - 1]) == tok.eos_token_id,
                         "mask_through_last": bool(batch.response_mask[i, :n].all()),
                         "mask_after_last": bool(batch.response_mask[i, n:].any())})
        if any(r["done"] and r["length"] < r["width"] for r in rows):
            break
    out["pad_eos_rows"] = rows

    # dropout: the engines run in train mode; two passes must give the same numbers
    obs, act, mask = batch.observation, batch.action, batch.mask
    actor, critic, ref = trainer.registry.get("actor"), trainer.registry.get("critic"), trainer.registry.get("ref")
    engines = trainer.c.engines
    out["engines_training"] = {"actor": engines["actor"].module.training, "critic": engines["critic"].module.training}
    with torch.no_grad():
        out["dropout_repeatable"] = {
            "actor": torch.equal(actor.get_logprob(obs, act, mask=mask), actor.get_logprob(obs, act, mask=mask)),
            "ref": torch.equal(ref.get_logprob(obs, act, mask=mask), ref.get_logprob(obs, act, mask=mask)),
            "critic": torch.equal(critic.get_values(obs, mask, act.shape[1]), critic.get_values(obs, mask, act.shape[1])),
        }
    with torch.enable_grad():  # the PPO update's forward, with grad
        out["dropout_repeatable"]["actor_update"] = torch.equal(
            actor.get_logprob(obs, act, mask=mask).detach(), actor.get_logprob(obs, act, mask=mask).detach())
    out["dropout_rates"] = sorted({f"{type(m).__name__}.{k}={v}" for e in engines.values()
                                   for m in e.module.modules() for k, v in vars(m).items()
                                   if "dropout" in k and isinstance(v, float)})

    # a real step with the configured reward, then reward functions that fail in three ways
    metrics = trainer.train_step()
    out["step"] = {k: metrics[k] for k in ("training/global_step", "actor/pg_loss", "critic/vf_loss",
                                           "response_length/mean")}
    out["reward_errors"] = {}
    for name in ("raises", "wrong_shape", "nan_reward"):
        trainer.ppo.swap("reward", build_reward(trainer.cfg, tok, trainer.derived, [f"{rewards_file}:{name}"], None, None))
        try:
            trainer.train_step()
            out["reward_errors"][name] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            out["reward_errors"][name] = {"type": type(exc).__name__, "message": str(exc)}
    trainer.close()
    with open(result_path, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2], sys.argv[3:])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
