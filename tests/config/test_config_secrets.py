"""server.token is never printed or saved: the config's dict/YAML forms redact it, `verl-ds config` prints it
redacted, and the run's config.yaml is written owner-only."""
import json
import os
import stat

import pytest
import yaml

from verl_ds.cli import main
from verl_ds.config import REDACTED, ConfigError, load_config, write_run_config

TOKEN = "tok-3f9a1c77e2"


def test_to_dict_and_to_yaml_redact_the_token():
    cfg = load_config(None, [f"server.token={TOKEN}"])
    assert cfg.server.token == TOKEN  # the run itself still has it
    assert cfg.to_dict()["server"]["token"] == REDACTED == "<redacted>"
    assert TOKEN not in cfg.to_yaml() and yaml.safe_load(cfg.to_yaml())["server"]["token"] == REDACTED
    assert cfg.to_dict(redact=False)["server"]["token"] == TOKEN  # internal use only
    assert load_config().to_dict()["server"]["token"] is None  # nothing to hide: null stays null


def test_verl_ds_config_prints_the_token_redacted(capsys):
    for extra in ([], ["--json"]):
        assert main(["config", f"server.token={TOKEN}", *extra]) == 0
        out = capsys.readouterr().out
        assert TOKEN not in out and REDACTED in out
    assert json.loads(out)["server"]["token"] == REDACTED


def test_write_run_config_is_owner_only_and_redacted(tmp_path):
    cfg = load_config(None, [f"server.token={TOKEN}", "trainer.seed=5"])
    path = tmp_path / "config.yaml"
    path.write_text("old")
    os.chmod(path, 0o644)  # an existing, world-readable file is tightened too
    assert write_run_config(cfg, str(path)) == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert TOKEN not in text and yaml.safe_load(text)["trainer"]["seed"] == 5
    fresh = tmp_path / "new.yaml"
    write_run_config(cfg, str(fresh))
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600


# the value of server.token as written, and every form of it the YAML parser could hand to an error message
@pytest.mark.parametrize("literal,forms", [
    ("12345678", ["12345678"]),
    ("0x1234abcd", ["0x1234abcd", "1234abcd", str(0x1234ABCD)]),  # a hex literal is a YAML int
    ("07654321", ["7654321", str(0o7654321)]),  # YAML 1.1 octal
    ("190:20:30", ["190:20:30", str(190 * 3600 + 20 * 60 + 30)]),  # YAML 1.1 base 60
    ("1e5", ["1e5", "100000"]),
    ("[abc123, def456]", ["abc123", "def456"]),
    ("{inner: zz9secret}", ["zz9secret", "inner"]),
    ("[abc123", ["abc123"]),  # not YAML at all: the parser's message quotes what it read
    ("!!binary zz9secret", ["zz9secret"]),
    ("!zz9secret x", ["zz9secret"]),  # an unknown tag: the parser names it
])
def test_a_bad_token_is_refused_by_key_without_showing_it(tmp_path, capsys, literal, forms):
    """Exit 2 naming server.token and what was expected, from an override and from a config file, and the
    value appears in no form (CLI output included). A file that is not YAML is refused by line and column
    (its keys are unknown then), so only values that parse are written to a file."""
    parses = not literal.startswith(("[abc", "!"))
    path = tmp_path / "cfg.yaml"
    path.write_text(f"server:\n  token: {literal}\n")
    messages = []
    for source in ([], [str(path)]) if parses else ([],):
        overrides = [] if source else [f"server.token={literal}"]
        with pytest.raises(ConfigError) as info:
            load_config(*(source or [None]), overrides)
        messages.append(str(info.value))
        assert main(["config", *(["--config", str(path)] if source else overrides)]) == 2
        out, err = capsys.readouterr()
        messages.append(out + err)
    for message in messages:
        assert "server.token" in message, message
        assert not [f for f in forms if f in message], message
    if parses:  # the error says what was expected
        assert "server.token: expected str or null, got " in messages[0]
