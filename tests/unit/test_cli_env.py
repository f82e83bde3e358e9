"""`keras-dist env`: a report for bug reports, without joining any cluster."""

import json

from keras_dist import _compat
from keras_dist.cli import main
from keras_dist.cli.env import collect_environment


def test_env_prints_versions_devices_cluster_and_fixes(capsys, monkeypatch):
    tf_config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for expected in (
        "### Versions",
        "- keras: 3.",
        "- tensorflow: 2.",
        "logical CPU devices (replicas): 4",  # tests/conftest.py simulates 4
        "- task: worker:1",
        "- is_chief: False",
        "- worker:0: 127.0.0.1:1",
        'strategy="auto" would use: multi_worker',
        "### Active compatibility fixes",
    ):
        assert expected in out
    for fix in _compat.active_fixes():  # Which are active depends on the stack's versions (docs/compat.md).
        assert f"- {fix.name}: https://" in out


def test_env_reports_an_invalid_tf_config_instead_of_failing():
    sections = collect_environment({"TF_CONFIG": "{oops"})
    assert sections["Cluster"]["error"].startswith("Invalid TF_CONFIG: `TF_CONFIG` is not valid JSON")
    assert sections["Strategy"] == {'strategy="auto" would use': "mirrored"}
    assert sections["Settings"] == {"KERAS_DIST_*": "none set"}
