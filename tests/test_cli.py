"""The command line: entry points, and the commands' output and exit codes (the stages' own logic is tested in
their modules' files)."""
import json
import subprocess
import sys

from autotune import cli
from autotune.calibration import texts


def test_python_m_autotune_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "autotune", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in cli.COMMANDS:
        assert name.replace("_", "-") in out.stdout


def test_models_command_lists_tiny_moe_with_its_load_shares(capsys):
    assert cli.main(["models", "--model", "tiny-moe", "--max-tokens", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (m,) = out["models"]
    assert (m["name"], m["layers"], m["experts"], m["top_k"]) == ("tiny-moe", 4, 16, 2)
    assert out["text"] == texts.DEFAULT_CALIB_TEXT and m["tokens"] == 1024
    assert 12e6 < m["parameters"] < 15e6
    assert len(m["expert_shares"]) == 4 and all(len(r) == 16 for r in m["expert_shares"].values())
    assert all(abs(sum(r) - 1) < 1e-3 for r in m["expert_shares"].values())


def test_models_command_rejects_unknown_models(capsys):
    assert cli.main(["models", "--model", "gpt-5"]) == 2
    assert "not a built-in model" in capsys.readouterr().err


def test_show_profile_on_a_truncated_file_exits_2(tmp_path, capsys):
    p = tmp_path / "t.json"
    p.write_text('{"schema": "npumoe.profile/1", "host": {')
    assert cli.main(["show-profile", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("error") == 1 and "not valid JSON" in err
