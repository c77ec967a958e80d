"""The one validation of a reward swap (HTTP, a config's reward section, a replayed swap), WITHOUT running any of
the request's code: user modules are parsed, never imported here."""
from __future__ import annotations

import ast
import difflib
import json
import math
import os
import re
import sys
from typing import Any, Iterable

from verl_ds.config.schema import MAX_REWARD_WEIGHT
from verl_ds.rewards import REWARD_FNS, SEQUENCE_REWARDS


def parse_reward_swap(spec: dict) -> dict:
    """``check_reward_spec`` for trusted callers (a config, or past the server's HTTP policy): code allowed."""
    return check_reward_spec(spec, allow_code=True, swappable=(), reward_model_dir=os.sep, vocab_size=None)


_SWAP_FIELDS = ("function", "functions", "model_path", "model_weight")
_FN_FIELDS = ("name", "weight", "per_token")
MAX_SWAP_FUNCTIONS = 16
_MAX_READ_BYTES = 1 << 20  # config.json / reward source files read in the HTTP thread
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_MODULE_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def check_reward_spec(spec: Any, *, allow_code: bool, swappable: Iterable[str], reward_model_dir: str | None,
                      vocab_size: int | None) -> dict:
    """The normalised ``{"functions", "model_path", "model_weight"}`` of a swap request, or ValueError; the rules:
    docs/http_api.md, "POST /v1/models/reward"."""
    if not isinstance(spec, dict):
        raise ValueError(f"reward swap: expected a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(_SWAP_FIELDS))
    if unknown:
        raise ValueError(f"reward swap: unknown field(s) {unknown}; expected {', '.join(_SWAP_FIELDS)}")
    listed = spec.get("functions")
    listed = [] if listed is None else listed
    if not isinstance(listed, list):
        raise ValueError(f"reward swap: functions: expected a list, got {type(listed).__name__} {listed!r:.80}")
    single = spec.get("function")
    if single is not None and not isinstance(single, str):
        raise ValueError(f"reward swap: function: expected a reward name (a string), got {single!r:.80}")
    entries = [(f"functions[{i}]", f) for i, f in enumerate(listed)] + ([("function", single)] if single else [])
    model_path = spec.get("model_path")
    if not entries and model_path is None:
        raise ValueError("reward swap: give 'function', 'functions' or 'model_path'")
    if len(entries) > MAX_SWAP_FUNCTIONS:
        raise ValueError(f"reward swap: {len(entries)} functions; at most {MAX_SWAP_FUNCTIONS} are allowed")
    swappable = {s for s in swappable}
    functions, short_names = [], {}
    for where, entry in entries:
        item = _swap_function(where, entry, allow_code, swappable)
        short = item["name"].rpartition(":")[2]  # the name it is registered (and logged) under
        if short in short_names or short == "reward_model":
            other = short_names.get(short, "the reward model's own metric")
            raise ValueError(f"reward swap: {where}: {item['name']!r} would be registered as {short!r}, "
                             f"like {other}; give each function a distinct name")
        short_names[short] = where
        functions.append(item)
    weight = spec.get("model_weight")
    if weight is not None:
        weight = _finite("model_weight", weight)
        if model_path is None:
            raise ValueError("reward swap: model_weight given without model_path")
    if model_path is not None:
        model_path = _check_reward_model(model_path, reward_model_dir, vocab_size)
    return {"functions": functions, "model_path": model_path, "model_weight": weight}


def _finite(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"reward swap: {where}: expected a number, got {value!r:.80}")
    try:
        out = float(value)
    except OverflowError:  # an int too large for a float
        out = math.inf
    if not math.isfinite(out):
        raise ValueError(f"reward swap: {where}: expected a finite number, got {value!r:.80}")
    if abs(out) > MAX_REWARD_WEIGHT:  # finite in float64, but the float32 scores it multiplies would overflow
        raise ValueError(f"reward swap: {where}: {value!r:.80} is out of range [-{MAX_REWARD_WEIGHT:g}, "
                         f"{MAX_REWARD_WEIGHT:g}] (weighted scores are float32)")
    return out


def _swap_function(where: str, entry: Any, allow_code: bool, swappable: set) -> dict:
    item = {"name": entry} if isinstance(entry, str) else entry
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or set(item) - set(_FN_FIELDS):
        raise ValueError(f"reward swap: {where}: expected a name or {{name, weight, per_token}}, got {entry!r:.200}")
    name = item["name"]
    if not name or name != name.strip() or len(name) > 1024 or "\x00" in name:
        raise ValueError(f"reward swap: {where}.name: expected a reward name without surrounding blanks "
                         f"(at most 1024 characters), got {name!r:.80}")
    weight = _finite(f"{where}.weight", item.get("weight", 1.0))
    per_token = item.get("per_token", False)
    if not isinstance(per_token, bool):
        raise ValueError(f"reward swap: {where}.per_token: expected true or false, got {per_token!r:.80}")
    if per_token and name in SEQUENCE_REWARDS:
        raise ValueError(f"reward swap: {where}.per_token: the shipped reward {name!r} scores whole sequences (one "
                         "float per sample); per_token must be false")
    if name not in REWARD_FNS and name not in swappable:
        if ":" not in name:
            pool = sorted(REWARD_FNS) + sorted(swappable)
            close = difflib.get_close_matches(name, pool, n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"reward swap: {where}: unknown reward function {name!r}; valid names: {sorted(REWARD_FNS)}"
                             f" and swappable {sorted(swappable)}.{hint}")
        if not allow_code:
            raise ValueError(
                f"reward swap: {where}: {name!r} is reward code that is not declared swappable; only the shipped "
                f"rewards {sorted(REWARD_FNS)} and server.swappable_rewards {sorted(swappable)} may be swapped in, "
                "and importing new code over HTTP is off (server.allow_reward_code=false)")
        _check_code_statically(where, name)
    return {"name": name, "weight": weight, "per_token": per_token}


def _check_code_statically(where: str, name: str) -> None:
    """'module:fn' / 'file.py:fn' exists and defines ``fn`` taking (prompts, responses, batch): read with ast."""
    place, _, attr = name.rpartition(":")
    if not place or not attr.isidentifier():
        raise ValueError(f"reward swap: {where}: expected 'module.path:function' or '/path/file.py:function', "
                         f"got {name!r}")
    if place.endswith(".py") or "/" in place or os.sep in place:
        path = os.path.realpath(place)
        if not os.path.isfile(path):
            raise ValueError(f"reward swap: {where}: file {place!r} does not exist")
    else:
        if not _MODULE_RE.fullmatch(place):
            raise ValueError(f"reward swap: {where}: {place!r} is not a module path (expected e.g. my_pkg.rewards)")
        path = _module_source(where, place)
    if os.path.getsize(path) > _MAX_READ_BYTES:
        raise ValueError(f"reward swap: {where}: {path!r} is over {_MAX_READ_BYTES} bytes; too large to check")
    try:
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"reward swap: {where}: {path!r} cannot be parsed: {type(e).__name__}: {e}") from None
    bound = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Name):
                    bound[target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound[(alias.asname or alias.name).split(".")[0]] = node
    node = bound.get(attr)
    if node is None:
        close = difflib.get_close_matches(attr, list(bound), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"reward swap: {where}: {path!r} defines no top-level {attr!r}{hint}")
    if isinstance(node, ast.ClassDef):
        raise ValueError(f"reward swap: {where}: {attr!r} is a class; expected a function returning the scores")
    if isinstance(node, ast.AsyncFunctionDef):
        raise ValueError(f"reward swap: {where}: {attr!r} is an async function; rewards are called synchronously")
    if isinstance(node, ast.FunctionDef) and not _takes_three_positional(node.args):
        raise ValueError(f"reward swap: {where}: {attr!r} must accept (prompts, responses, batch)")


def _takes_three_positional(args: ast.arguments) -> bool:
    positional = len(args.posonlyargs) + len(args.args)
    required = positional - len(args.defaults)
    required_kw = sum(d is None for d in args.kw_defaults)
    return required <= 3 and (positional >= 3 or args.vararg is not None) and required_kw == 0


def _module_source(where: str, module: str) -> str:
    """The .py file of ``module``, found by the import system's finders without executing any module."""
    search, spec = None, None
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = getattr(loaded, "__spec__", None)
        else:
            spec = next((s for f in sys.meta_path if hasattr(f, "find_spec") for s in [f.find_spec(name, search)]
                         if s is not None), None)
        if spec is None:
            raise ValueError(f"reward swap: {where}: module {name!r} not found")
        search = spec.submodule_search_locations
        if i < len(parts) and search is None:
            raise ValueError(f"reward swap: {where}: {name!r} is a module, not a package")
    origin = spec.origin if spec.has_location else None
    if spec.submodule_search_locations is not None and origin is None:
        raise ValueError(f"reward swap: {where}: {module!r} is a namespace package, not a module")
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        raise ValueError(f"reward swap: {where}: module {module!r} has no Python source file ({spec.origin or 'no file'}), "
                         "so it cannot be checked without running it")
    return origin


def _check_reward_model(model_path: Any, reward_model_dir: str | None, vocab_size: int | None) -> str:
    """The resolved ``model_path`` after the checks of ``check_reward_spec`` (config.json only)."""
    if reward_model_dir is None:
        raise ValueError("reward swap: model_path is refused: no reward model directory is configured "
                         "(server.reward_model_dir), so reward models cannot be swapped in over HTTP")
    if not isinstance(model_path, str) or not model_path.strip():
        raise ValueError(f"reward swap: model_path: expected a directory path, got {model_path!r:.80}")
    root, real = os.path.realpath(reward_model_dir), os.path.realpath(model_path)
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f"reward swap: model_path {model_path!r} resolves to {real!r}, outside the reward model "
                         f"directory {root!r} (server.reward_model_dir)")
    if not os.path.isdir(real):
        raise ValueError(f"reward swap: model_path {model_path!r} is not a local directory")
    where = f"reward swap: model_path {model_path!r}"
    config_file = os.path.join(real, "config.json")
    if not os.path.isfile(config_file):
        found = sorted(os.listdir(real))
        raise ValueError(f"{where} has no config.json; expected a checkpoint saved with save_pretrained, found "
                         f"{found[:10] if found else 'an empty directory'}")
    try:
        if os.path.getsize(config_file) > _MAX_READ_BYTES:
            raise ValueError(f"over {_MAX_READ_BYTES} bytes")
        with open(config_file, "rb") as fh:
            config = json.loads(fh.read())
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{where}: config.json cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: config.json is a JSON {type(config).__name__}, expected an object")
    archs = config.get("architectures")
    if not isinstance(archs, list) or not any(isinstance(a, str) and a.endswith("ForSequenceClassification")
                                              for a in archs):
        raise ValueError(f"{where} is not a sequence-classification checkpoint: config.json architectures is "
                         f"{archs!r:.200}; expected e.g. ['LlamaForSequenceClassification']")
    labels = config.get("num_labels")
    if labels is None and isinstance(config.get("id2label"), dict):
        labels = len(config["id2label"])
    if labels != 1:
        found = "none declared (neither num_labels nor id2label)" if labels is None else f"{labels!r:.40}"
        raise ValueError(f"{where}: a reward model needs exactly 1 label (one score), config.json has {found}")
    if vocab_size is not None:
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        vocab = config.get("vocab_size", text.get("vocab_size"))
        if isinstance(vocab, bool) or not isinstance(vocab, int):
            raise ValueError(f"{where}: config.json declares no integer vocab_size (found {vocab!r:.40}); cannot "
                             f"check it against the policy tokenizer's {vocab_size} tokens")
        if vocab < vocab_size:
            raise ValueError(f"{where}: vocab_size {vocab} is smaller than the policy tokenizer's {vocab_size} tokens;"
                             " the reward model must embed every token the policy can produce")
    if not any(os.path.isfile(os.path.join(real, f)) for f in _WEIGHT_FILES) and \
            not any(f.endswith(".safetensors") for f in os.listdir(real)):
        raise ValueError(f"{where} has no weights: expected one of {list(_WEIGHT_FILES)}")
    return real
