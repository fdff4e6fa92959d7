"""The environment is validated once, with errors that name the variable."""
import os
import subprocess
import sys

import pytest

from bps_gc.config import Config, ConfigError
from conftest import LAUNCH_PYTHONPATH, ROOT

BASE = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000", "DMLC_WORKER_ID": "1"}


def test_defaults_and_ranks():
    cfg = Config.from_env(dict(BASE, BYTEPS_LOCAL_SIZE="4", BYTEPS_LOCAL_RANK="2"))
    assert (cfg.rank, cfg.size, cfg.distributed) == (6, 8, True)
    assert (cfg.partition_bytes, cfg.min_compress_bytes, cfg.enable_async) == (4_096_000, 65_536, False)
    assert cfg.dense_partition_bytes is None  # chosen from the address book (comm/placement.py)
    assert cfg.agreement()["BPS_GC_DENSE_PARTITION_BYTES"] == "unset"
    assert cfg.threadpool_size >= 1 and cfg.server_engine_threads >= 1
    single = Config.from_env(dict(BASE, DMLC_NUM_WORKER="1", DMLC_WORKER_ID="0"))
    assert not single.distributed
    assert Config.from_env(dict(BASE, DMLC_NUM_WORKER="1", DMLC_WORKER_ID="0",
                                BYTEPS_FORCE_DISTRIBUTED="1")).distributed
    # BPS_GC_ELASTIC with local ranks: each pushes for itself (what "auto" means there)
    elastic = Config.from_env(dict(BASE, BYTEPS_LOCAL_SIZE="2", BPS_GC_ELASTIC="1", BPS_GC_LOCAL_REDUCE="1"))
    assert (elastic.hierarchy, elastic.local_reduce, elastic.fusion_bytes) == ("flat", False, 0)
    # two levels when asked for (the host's sum, one push per host; docs/elastic.md)
    two = Config.from_env(dict(BASE, BYTEPS_LOCAL_SIZE="2", BPS_GC_ELASTIC="1", BPS_GC_HIERARCHY="host"))
    assert (two.hierarchy, two.shm, two.fusion_bytes) == ("host", False, 0)


@pytest.mark.parametrize("change, variable, fragment", [
    ({"DMLC_ROLE": "boss"}, "DMLC_ROLE", "allowed: scheduler, server, worker"),
    ({"DMLC_ROLE": None}, "DMLC_ROLE", "required"),
    ({"DMLC_NUM_WORKER": "two"}, "DMLC_NUM_WORKER", "integer"),
    ({"DMLC_NUM_WORKER": "0"}, "DMLC_NUM_WORKER", ">= 1"),
    ({"DMLC_NUM_SERVER": None}, "DMLC_NUM_SERVER", "required"),
    ({"DMLC_PS_ROOT_URI": ""}, "DMLC_PS_ROOT_URI", "required"),
    ({"DMLC_PS_ROOT_PORT": "70000"}, "DMLC_PS_ROOT_PORT", "[1, 65535]"),
    ({"DMLC_WORKER_ID": None}, "DMLC_WORKER_ID", "required"),
    ({"DMLC_WORKER_ID": "2"}, "DMLC_WORKER_ID", "[0, 1]"),
    ({"BYTEPS_LOCAL_RANK": "1"}, "BYTEPS_LOCAL_RANK", "[0, 0]"),
    ({"BYTEPS_PARTITION_BYTES": "4MB"}, "BYTEPS_PARTITION_BYTES", "integer"),
    ({"BYTEPS_ENABLE_ASYNC": "maybe"}, "BYTEPS_ENABLE_ASYNC", "0 or 1"),
    ({"BYTEPS_LOG_LEVEL": "LOUD"}, "BYTEPS_LOG_LEVEL", "TRACE, DEBUG"),
    ({"BPS_GC_HEARTBEAT_TIMEOUT": "0.1", "BPS_GC_HEARTBEAT_INTERVAL": "1"}, "BPS_GC_HEARTBEAT_TIMEOUT", "exceed"),
    ({"BPS_GC_HEARTBEAT_INTERVAL": "fast"}, "BPS_GC_HEARTBEAT_INTERVAL", "number"),
    ({"BPS_GC_ELASTIC": "1", "BYTEPS_ENABLE_ASYNC": "1"}, "BPS_GC_ELASTIC", "needs synchronous rounds"),
])
def test_bad_variable_is_named(change, variable, fragment):
    env = dict(BASE)
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    with pytest.raises(ConfigError) as err:
        Config.from_env(env)
    assert err.value.variable == variable
    assert str(err.value).startswith(variable) and fragment in str(err.value)


def test_node_exits_2_naming_the_variable():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(BASE, DMLC_ROLE="server", DMLC_NUM_SERVER="many", PYTHONPATH=LAUNCH_PYTHONPATH)
    result = subprocess.run([sys.executable, "-m", "bps_gc.node"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "DMLC_NUM_SERVER: must be an integer, got 'many'" in result.stderr
