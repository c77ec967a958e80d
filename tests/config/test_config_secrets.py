"""server.token is never printed or saved: the config's dict/YAML forms redact it, `verl-ds config` prints it
redacted, and the run's config.yaml is written owner-only."""
import json
import os
import stat

import yaml

from verl_ds.cli import main
from verl_ds.config import REDACTED, load_config, write_run_config

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
