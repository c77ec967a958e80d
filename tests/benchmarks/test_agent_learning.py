"""benchmarks/agent_learning.py's PPO variant (--ppo): the overrides it trains with are the shipped PPO config."""
import os

from benchmark_scripts import BENCHMARKS, load_benchmark

from verl_ds.config import load_config

CONFIGS = BENCHMARKS.parent / "configs"


def test_ppo_overrides_turn_the_grpo_config_into_the_shipped_ppo_config():
    bench = load_benchmark("agent_learning")
    overrides = bench.overrides_for(True, ["trainer.output_dir=runs/agent_calc_ppo"])
    via_flag = load_config(os.fspath(CONFIGS / "agent_calc.yaml"), overrides)
    assert via_flag == load_config(os.fspath(CONFIGS / "agent_calc_ppo.yaml"))
    assert via_flag.algo.adv_estimator == "gae" and not via_flag.algo.whiten_advantages


def test_the_command_lines_keys_win_and_without_the_flag_nothing_is_added():
    bench = load_benchmark("agent_learning")
    assert bench.overrides_for(False, ["trainer.total_steps=80"]) == ["trainer.total_steps=80"]
    got = bench.overrides_for(True, ["algo.lam=0.95", "trainer.total_steps=80"])
    assert got == ["algo.adv_estimator=gae", "algo.whiten_advantages=false", "algo.lam=0.95", "trainer.total_steps=80"]
    load_config(os.fspath(CONFIGS / "agent_calc.yaml"), got)  # no key given twice
