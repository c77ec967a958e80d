"""The ``verl-ds`` command: ``train`` (the RL job), ``sft``, ``rm``, ``dpo`` (``verl_ds.stages``), ``config``, ``plan``,
``state``. A bad config exits with status 2 and one line naming the culprit, before anything is built."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
import warnings

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.yaml")


def _quiet_environment() -> None:
    """Defaults that keep CPU runs quiet and fast; a user's own settings win."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # the deepspeed launcher does not set it, and 2 ranks x all cores thrash a small machine
    if "OMP_NUM_THREADS" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*TRANSFORMERS_CACHE.*")


def _config_args(p: argparse.ArgumentParser, launched: bool = False) -> None:
    if launched:
        p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--config", default=None, help=f"YAML config (default: {os.path.relpath(DEFAULT_CONFIG)} when it exists)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. actor.lr=1e-4 trainer.total_steps=10")


def _load(args, default: str = DEFAULT_CONFIG):
    from verl_ds.config import load_config

    path = args.config if args.config is not None else (default if os.path.isfile(default) else None)
    return load_config(path, args.overrides)


def _logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def stage_module(name: str):
    """``verl_ds.stages.<name>`` (its ``JOB`` class runs the job); ConfigError when this build has no such job."""
    import importlib
    import importlib.util

    from verl_ds.config import ConfigError
    from verl_ds.stages import STAGES

    module_name = f"verl_ds.stages.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        here = ", ".join(s for s in STAGES if importlib.util.find_spec(f"verl_ds.stages.{s}"))
        raise ConfigError(f"verl-ds {name}: this installation has no {name} job ({module_name} is missing); the "
                          f"jobs here: train, {here}") from None
    if not hasattr(module, "JOB"):
        raise ConfigError(f"verl-ds {name}: {module_name} defines no JOB (the StageJob subclass that runs it)")
    return module


def cmd_stage(args) -> int:
    """A supervised-style job (sft, rm, dpo): the same gate, launchers and run directory as ``train``."""
    from verl_ds.dist import detect_launch
    from verl_ds.stages.gate import check_stage
    from verl_ds.stages.spine import format_summary

    job_cls = stage_module(args.command).JOB
    cfg = _load(args, os.path.join(os.path.dirname(DEFAULT_CONFIG), f"{args.command}.yaml"))
    launch = detect_launch(local_rank_arg=args.local_rank)
    # refused before torch.distributed or any model starts
    check_stage(cfg, launch.world_size, launch.rank, job=args.command)
    _logging(launch.rank)
    data = job_cls.load_data(cfg)  # unusable data exits 2 before torch.distributed
    _set_threads(launch)
    return _run(job_cls(cfg, launch, data=data), cfg, launch, f"verl_ds {args.command}", format_summary,
                launch.world_size)


def _set_threads(launch) -> None:
    import torch

    if launch.world_size > 1 or "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))


def _run(job, cfg, launch, banner: str, format_summary, processes: int) -> int:
    """Fit a built job (rank 0 prints the resolved config first and the summary last), then end the process."""
    from verl_ds import dist as vdist

    if launch.rank == 0:
        print(f"{banner}: launcher={launch.launcher} world_size={launch.world_size} "
              f"master={launch.master_addr}:{launch.master_port}\n--- resolved config ---\n{cfg.to_yaml()}---",
              flush=True)
    summary = job.fit()
    if launch.rank == 0:
        print(format_summary(summary), flush=True)
    vdist.shutdown()
    return vdist.exit_after_shutdown(0, processes)


def cmd_train(args) -> int:
    from verl_ds.dist import detect_launch
    from verl_ds.run.startup import check_startup

    cfg = _load(args)
    launch = detect_launch(local_rank_arg=args.local_rank)
    processes, split = launch.world_size, cfg.rollout.split_ranks
    if split and split >= launch.world_size:
        from verl_ds.config import ConfigError

        raise ConfigError(f"rollout.split_ranks={split} leaves no training rank in a world of {launch.world_size}")
    # split placement: the training ranks' world is the first world - split ranks (verl_ds.asyncrl.split)
    check_startup(cfg, launch.world_size - split, min(launch.rank, launch.world_size - split - 1) if split else
                  launch.rank)  # refuse a bad job before torch.distributed or any model starts
    _logging(launch.rank)
    from verl_ds.builder import load_data

    data = load_data(cfg)  # the prompt sets are part of the gate: unusable data exits 2 before torch.distributed

    from verl_ds.report import format_summary
    from verl_ds.testing.faults import install_from_env
    from verl_ds.trainer import Trainer

    _set_threads(launch)
    if split:
        from verl_ds.asyncrl import split as split_placement

        launch, code = split_placement.start(cfg, launch, data)
        if code is not None:  # a generation rank: its whole run is over
            from verl_ds import dist as vdist

            return vdist.exit_after_shutdown(code, processes)
    trainer = Trainer(cfg, launch, data=data)
    # VERL_DS_FAULT: tests break real runs at chosen points
    install_from_env(trainer.rank, trainer.add_event_listener, trainer.actor_engine.module)
    return _run(trainer, cfg, launch, "verl_ds", format_summary, processes)


def cmd_config(args) -> int:
    from verl_ds.config import describe
    from verl_ds.run.checks import check_config
    from verl_ds.resolved_config import registry_choices
    from verl_ds.run.startup import check_startup

    if args.describe:
        print(describe(registry_choices()))
        return 0
    cfg = _load(args)
    (check_startup if args.check else check_config)(cfg, args.world_size)
    print(cfg.to_yaml() if not args.json else json.dumps(cfg.to_dict(), indent=1))  # server.token redacted
    return 0


def cmd_plan(args) -> int:
    from verl_ds.plan import plan

    cfg = _load(args)
    config_path = args.config if args.config is not None else os.path.relpath(DEFAULT_CONFIG)
    world = args.world_size or args.nodes * (args.gpus_per_node or 1)
    try:
        print(plan(cfg, world, nodes=args.nodes, gpus_per_node=args.gpus_per_node, config_path=config_path,
                   overrides=tuple(args.overrides), memory_gib=args.memory_gib))
    except ValueError as exc:
        print(f"verl_ds: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-ds", description="PPO for HF causal LMs on DeepSpeed ZeRO-3")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run PPO training (what launch/train.py runs)")
    _config_args(p, launched=True)
    p.set_defaults(func=cmd_train)
    for name, what in (("sft", "supervised fine-tuning on prompt/completion or chat rows"),
                       ("rm", "train a reward model (Bradley-Terry) on preference pairs"),
                       ("dpo", "direct preference optimisation on preference pairs")):
        p = sub.add_parser(name, help=f"{what} (launch/{name}.py; default config configs/{name}.yaml)")
        _config_args(p, launched=True)
        p.set_defaults(func=cmd_stage)
    p = sub.add_parser("config", help="print the resolved, validated config (or --describe every key)")
    _config_args(p)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--describe", action="store_true", help="a table of every key with type, default and help")
    p.add_argument("--check", action="store_true",
                   help="also run the start-up checks (paths, reward functions, checkpoint, device, server)")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("plan", help="per-rank memory estimate, batch arithmetic and launch commands, before launching")
    _config_args(p)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--world-size", type=int, default=None, help="default: nodes x gpus-per-node")
    p.add_argument("--memory-gib", type=float, default=None, help="memory per GPU (default: the config's device's, "
                   "or 80 GiB): plan says whether the busiest moment fits")
    p.set_defaults(func=cmd_plan)
    sub.add_parser("state", help="read or change a running job's SharedState over HTTP (get | set key=value ...)")
    return parser


def main(argv=None) -> int:
    """Run a command; a rank of a multi-rank run that fails or is preempted exits with its status here."""
    try:
        code = _main(argv)
    except SystemExit as exc:  # Preempted (75) and sys.exit below the command
        if not _multi_rank():
            raise
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"): printed, status 1, as the interpreter does
            print(exc.code, file=sys.stderr, flush=True)
            code = 1
    except BaseException as exc:  # an unexplained error: its traceback and the interpreter's status
        if not _multi_rank():
            raise
        traceback.print_exc()
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    vdist = sys.modules.get("verl_ds.dist")  # not imported: no process group (``state`` never imports torch)
    return vdist.end_failed_process(code) if code and vdist is not None else code


def _multi_rank() -> bool:
    vdist = sys.modules.get("verl_ds.dist")
    return vdist is not None and vdist.multi_rank_process()


def _main(argv) -> int:
    _quiet_environment()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["state"]:  # the HTTP client parses its own flags (--url, --token, --help)
        from verl_ds.client import main as state_main

        return state_main(argv[1:])
    args = build_parser().parse_args(argv)
    return explained(lambda: args.func(args))


def explained(run) -> int:
    """``run()``'s status, or one ``verl_ds: error:`` line for an error the package explains (2: refused before
    anything was built; 1: failed while running). In-process jobs (scripts/pipeline.py) end here too."""
    from verl_ds.config import ConfigError
    from verl_ds.dist import LaunchError

    from verl_ds.checkpoint import CheckpointError
    from verl_ds.models.reward import RewardFunctionError
    from verl_ds.runtime import NonFiniteError, RankFailure
    from verl_ds.runtime.run_lock import RunDirectoryBusy

    try:
        return run()
    except (ConfigError, LaunchError, RunDirectoryBusy) as exc:  # caught before any model was built
        print(f"verl_ds: error: {_one_line(exc)}", file=sys.stderr, flush=True)
        return 2
    except (RankFailure, NonFiniteError, RewardFunctionError, CheckpointError) as exc:  # explained: one clear line
        print(f"verl_ds: error: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # SIGINT before the trainer took it over (start-up): nothing was trained yet
        print("verl_ds: interrupted (SIGINT) during start-up, before any step: nothing to save", file=sys.stderr,
              flush=True)
        return 130


def _one_line(exc: BaseException) -> str:
    """The message on one line (a YAML or JSON parser's may span several), so logs keep one line per failure."""
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
