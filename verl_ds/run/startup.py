"""The start-up gate: every check that can refuse a job before torch.distributed is initialised or any model is
built. ``check_common`` holds the machine checks any job needs; ``check_startup`` is the RL job's gate: its config, its
own machine checks (critic and reward-model directories, reward code, sandbox, server), then ``check_common``. Each
problem is one ConfigError naming the key, what was expected and what was found (docs/config.md)."""
from __future__ import annotations

import os
import socket
import sys
from typing import Optional

from verl_ds import checkpoint
from verl_ds.agent.code_reward import code_tests_reward
from verl_ds.agent.registry import make_environment
from verl_ds.agent.sandbox import SandboxUnavailable, require_sandbox
from verl_ds.agent.tools import python
from verl_ds.attention_layout import resolve_attn_implementation
from verl_ds.config import TOKEN_ENV, Config, ConfigError, Derived, is_loopback, tiny_model_fields
from verl_ds.engines.teacher import check_teacher
from verl_ds.rewards import resolve_reward_fn
from verl_ds.run.checks import check_config
from verl_ds.run.ports import check_bind

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")
# what verl_ds.data.PromptDataset.from_file reads; a directory must be a datasets save_to_disk folder
DATA_EXTENSIONS = (".jsonl", ".ndjson", ".json", ".parquet")
_SAVED_DATASET_FILES = (("state.json", "dataset_info.json"), ("dataset_dict.json",))  # a Dataset, a DatasetDict


def _check_dir(key: str, path: Optional[str], need: tuple, what: str) -> None:
    if path is None:
        return
    if not os.path.exists(path):
        raise ConfigError(f"{key}: {path!r} does not exist")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is not a directory (expected a local HF {what} directory)")
    if need and not any(os.path.isfile(os.path.join(path, n)) for n in need):
        raise ConfigError(f"{key}: {path!r} has no {what} files (looked for {', '.join(need)})"
                          + ("; point model.tokenizer_path at the tokenizer" if what == "tokenizer" else ""))


def _check_model(cfg: Config) -> None:
    """The trained model's directory and its tokenizer's."""
    m = cfg.model
    _check_dir("model.path", m.path, ("config.json",), "model")
    if m.tokenizer_path is not None:
        _check_dir("model.tokenizer_path", m.tokenizer_path, _TOKENIZER_FILES, "tokenizer")
    elif m.path is not None:
        _check_dir("model.path", m.path, _TOKENIZER_FILES, "tokenizer")


def _check_data_file(key: str, path: Optional[str]) -> None:
    if path is None:
        return
    if not os.path.exists(path):
        raise ConfigError(f"{key}: {path!r} does not exist")
    if os.path.isdir(path):
        if not any(all(os.path.isfile(os.path.join(path, n)) for n in names) for names in _SAVED_DATASET_FILES):
            raise ConfigError(f"{key}: {path!r} is a directory but not a data set saved with datasets' save_to_disk "
                              f"(no state.json + dataset_info.json, nor dataset_dict.json); give a "
                              f"{', '.join(DATA_EXTENSIONS)} file or such a directory")
        return
    if not os.path.isfile(path):  # a FIFO or a device: opening it blocks or reading never ends
        raise ConfigError(f"{key}: {path!r} is not a regular file (a FIFO, socket or device); expected a "
                          f"{', '.join(DATA_EXTENSIONS)} file or a datasets save_to_disk directory")
    ext = os.path.splitext(path)[1].lower()
    if ext not in DATA_EXTENSIONS:
        raise ConfigError(f"{key}: {path!r} has the unsupported extension {ext or '(none)'!r}; supported: "
                          f"{', '.join(DATA_EXTENSIONS)} files, or a datasets save_to_disk directory")
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise ConfigError(f"{key}: {path!r} cannot be read: {exc.strerror or exc}") from None
    if ext == ".parquet":
        _check_parquet(key, path)


def _check_parquet(key: str, path: str) -> None:
    """Read the footer (schema and row groups, not the rows): a truncated or corrupt file fails here."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{key}: reading {path!r} needs pyarrow (pip install pyarrow)") from None
    try:
        pq.ParquetFile(path).metadata
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... depending on the damage
        raise ConfigError(f"{key}: {path!r} is not a readable Parquet file ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]})") from None


def _check_reward_code(cfg: Config) -> None:
    specs = [(f"reward.functions[{i}]", s if isinstance(s, str) else s.get("name"))
             for i, s in enumerate(cfg.reward.functions)]
    specs += [(f"server.swappable_rewards[{i}]", s) for i, s in enumerate(cfg.server.swappable_rewards)]
    for where, name in specs:
        try:
            resolve_reward_fn(name)
        except (ValueError, TypeError, ImportError) as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _model_code_users(cfg: Config) -> list[str]:
    """The keys whose setting runs model-written code: the code_tests reward, an environment with the python tool."""
    names = [(f"reward.functions[{i}]", s if isinstance(s, str) else s.get("name"))
             for i, s in enumerate(cfg.reward.functions)]
    names += [(f"server.swappable_rewards[{i}]", s) for i, s in enumerate(cfg.server.swappable_rewards)]
    users = [f"{where}={name}" for where, name in names if resolve_reward_fn(name) is code_tests_reward]
    if cfg.agent.environment is not None:
        try:
            tools = getattr(make_environment(cfg.agent.environment, cfg.agent.env_args), "tools", None)
        except Exception:  # noqa: BLE001 - a broken environment is refused where it is built, with its own message
            tools = None
        if python in getattr(tools, "tools", ()):
            users.append(f"agent.environment={cfg.agent.environment} (its python tool)")
    return users


def _check_sandbox(cfg: Config, rank: int) -> None:
    """A run that executes model-written code needs the bubblewrap sandbox, or agent.allow_weak_sandbox; the
    isolation in force is printed once (rank 0)."""
    users = _model_code_users(cfg)
    if not users:
        return
    try:
        line = require_sandbox(cfg.agent.allow_weak_sandbox)
    except SandboxUnavailable as exc:
        raise ConfigError(f"agent.allow_weak_sandbox: {', '.join(users)} runs model-written code; {exc}") from None
    if rank == 0:
        print(f"verl_ds: sandbox for model-written code ({', '.join(users)}): {line}", file=sys.stderr, flush=True)


def _check_output_dir(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"trainer.output_dir: cannot create {out!r} ({exc.strerror})") from None
    if not os.path.isdir(out) or not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"trainer.output_dir: {out!r} is not a writable directory")


def _check_resume(cfg: Config) -> None:
    resume = cfg.trainer.resume
    if resume in ("auto", "none"):
        return
    hint = (f"expected a checkpoint directory global_step_<N> (under {os.path.join(cfg.trainer.output_dir, 'checkpoints')!r}"
            f" for this run), or 'auto' / 'none'")
    try:
        checkpoint.step_of(resume)
    except checkpoint.CheckpointError:
        raise ConfigError(f"trainer.resume: {resume!r} is not a checkpoint directory; {hint}") from None
    why = checkpoint.verify(resume, digests=False)  # sizes only here; the load re-hashes
    if why is not None:
        raise ConfigError(f"trainer.resume: {resume!r} is not a complete checkpoint ({why}); {hint}")


def _built_model_params(cfg: Config) -> int:
    """Parameters of the decoder layers of the model built from config (llama / qwen2 shapes; the embeddings,
    which depend on the tokenizer, left out: a lower bound)."""
    f = tiny_model_fields(cfg)
    h = f["hidden_size"]
    kv = h // f["num_attention_heads"] * f["num_key_value_heads"]
    return f["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * f["intermediate_size"] + 2 * h)


def _physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX, or not reported
        return None


def _check_built_model_fits(cfg: Config) -> None:
    """A model built from config trains on this machine's memory when the engines run on the CPU: its fp32
    weights, gradients and Adam's two moments (16 bytes a parameter, however ZeRO partitions them across the
    ranks) must fit, or the job would be killed for memory after minutes of building."""
    total = _physical_memory()
    if cfg.model.path is not None or total is None:
        return
    params = _built_model_params(cfg)
    need = 16 * params
    if need > total:
        f = tiny_model_fields(cfg)
        raise ConfigError(f"model.config_overrides: hidden_size={f['hidden_size']}, intermediate_size="
                          f"{f['intermediate_size']}, num_hidden_layers={f['num_hidden_layers']}: the model built "
                          f"from config has at least {params:.3g} "
                          f"parameters; training it on the CPU needs at least 16 bytes each (fp32 weights, gradients, "
                          f"Adam's two moments) = {need / 2**30:.0f} GiB, more than this machine's "
                          f"{total / 2**30:.0f} GiB of memory; expected a smaller model (or model.path)")


def _check_device(cfg: Config) -> None:
    if cfg.trainer.device != "cuda":
        import torch

        if cfg.trainer.device == "cpu" or not torch.cuda.is_available():
            _check_built_model_fits(cfg)
        return
    import torch

    if not torch.cuda.is_available():
        built = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"trainer.device: 'cuda' but CUDA is not available ({built}, torch {torch.__version__}); "
                          "use trainer.device=auto or cpu")


def _check_sequence_parallel_heads(cfg: Config, models: tuple) -> None:
    """Heads and key/value heads of the ``(key, path)`` models read from disk (config.json) against
    model.sequence_parallel_size."""
    import json

    sp = cfg.model.sequence_parallel_size
    for key, path in models:
        if sp == 1 or path is None:
            continue
        with open(os.path.join(path, "config.json")) as fh:
            conf = json.load(fh)
        conf = conf.get("text_config") or conf
        heads = conf.get("num_attention_heads")
        kv = conf.get("num_key_value_heads") or heads
        if isinstance(heads, int) and (heads % sp or kv % sp):
            raise ConfigError(f"model.sequence_parallel_size={sp} must divide the attention heads ({heads}) and the "
                              f"key/value heads ({kv}) of {key}={path!r}: each rank attends heads/{sp} of them")


def _check_attention(cfg: Config) -> None:
    import torch

    cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    try:
        resolve_attn_implementation(cfg.model.attn_implementation, "cuda" if cuda else "cpu")
    except ValueError as exc:
        raise ConfigError(f"model.attn_implementation: {exc}") from None


def _check_server(cfg: Config, rank: int) -> None:
    s = cfg.server
    if not s.enabled:
        return
    try:
        socket.getaddrinfo(s.host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"server.host: {s.host!r} does not resolve to an address ({exc}); expected an IP address "
                          "or a resolvable host name of this machine, e.g. 127.0.0.1") from None
    token = (s.token or os.environ.get(TOKEN_ENV) or "").strip()
    if not token and not is_loopback(s.host):
        raise ConfigError(f"server.host: {s.host!r} is reachable from other machines and no token is set, so anyone "
                          f"could change the run; set {TOKEN_ENV}=<secret> (or server.token), or bind "
                          "server.host=127.0.0.1")
    if s.reward_model_dir is not None and not os.path.isdir(s.reward_model_dir):
        raise ConfigError(f"server.reward_model_dir: {s.reward_model_dir!r} is not an existing directory")
    if rank == 0:  # the server runs on rank 0 only; other ranks on this machine would race it for the port
        check_bind(s.host, s.port)


def check_common(cfg: Config) -> None:
    """The machine checks any job needs, the RL job's and the supervised ones': the device and attention kernel, the
    trained model and its tokenizer, the data files, the checkpoint to resume and the run directory (created last, once
    nothing else refused the job). ConfigError naming the key."""
    _check_device(cfg)
    _check_attention(cfg)
    _check_model(cfg)
    _check_sequence_parallel_heads(cfg, (("model.path", cfg.model.path),))
    _check_data_file("data.train_files", cfg.data.train_files)
    _check_data_file("data.val_files", cfg.data.val_files)
    _check_resume(cfg)
    _check_output_dir(cfg.trainer.output_dir)


def check_startup(cfg: Config, world_size: int = 1, rank: int = 0) -> Derived:
    """The RL job's gate: ``check_config(cfg, world_size)``, the critic and reward-model directories, reward
    functions, the sandbox and the server (on ``rank`` 0, that its address can be bound), then ``check_common``.
    Returns the Derived sizes; raises ConfigError naming the key."""
    derived = check_config(cfg, world_size)
    _check_dir("model.critic_path", cfg.model.critic_path, ("config.json",), "model")
    _check_dir("reward.model_path", cfg.reward.model_path, ("config.json",), "model")
    check_teacher(cfg)  # distill.teacher_path: a causal LM sharing the actor's tokenizer
    _check_sequence_parallel_heads(cfg, (("model.critic_path", cfg.model.critic_path),))
    _check_reward_code(cfg)
    _check_sandbox(cfg, rank)
    _check_server(cfg, rank)
    check_common(cfg)
    return derived
