"""Security settings are never silently ignored (docs/settings.md, "Security"): the
torch.distributed transport refuses BPS_GC_AUTH_TOKEN/BPS_GC_ENCRYPT at start, the store it
hosts listens on the rendezvous address only, and the parameter server warns once when it
listens beyond loopback with no token. Real torchrun, real sockets, `ss` for what listens."""
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import zmq

from bps_gc.config import ConfigError
from bps_gc.launcher.local import free_port
from bps_gc.wire import sockets
from collective_cluster import job_env, torchrun_argv
from conftest import LAUNCH_PYTHONPATH, ROOT

INIT_SCRIPT = "import bps_gc.torch as bps; bps.init(); print('started')"
needs_ss = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to see what listens")


@pytest.mark.parametrize("setting", [{"BPS_GC_AUTH_TOKEN": "s3cret"},
                                     {"BPS_GC_AUTH_TOKEN": "s3cret", "BPS_GC_ENCRYPT": "1"},
                                     {"BPS_GC_ENCRYPT": "1"}])
def test_torchrun_refuses_security_settings_at_start(setting, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(INIT_SCRIPT)
    result = subprocess.run(torchrun_argv([str(script)], 1), env=job_env(setting), capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode != 0 and "started" not in result.stdout, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("bps_gc: ConfigError")]
    assert len(lines) == 1, result.stderr[-3000:]
    line = lines[0]
    assert line.startswith(f"bps_gc: ConfigError: {next(iter(setting))}:"), line
    assert "cannot authenticate or encrypt" in line and "parameter server" in line and "which can" in line
    assert 'File "' + os.path.join(ROOT, "bps_gc") not in result.stderr  # no traceback of ours


def test_ddp_hook_refuses_the_token(monkeypatch):
    from bps_gc.torch.ddp.hook import comm_hook
    monkeypatch.setenv("BPS_GC_AUTH_TOKEN", "s3cret")
    with pytest.raises(ConfigError, match="BPS_GC_AUTH_TOKEN: the torch.distributed transport cannot"):
        comm_hook({"compressor": "onebit", "ef": "vanilla"})
    monkeypatch.delenv("BPS_GC_AUTH_TOKEN")
    assert comm_hook({"compressor": "onebit", "ef": "vanilla"}) is not None  # and only for that


def test_unset_and_zero_settings_are_not_refused():
    from bps_gc.collective.security import refuse_security_settings
    refuse_security_settings({})
    refuse_security_settings({"BPS_GC_AUTH_TOKEN": "", "BPS_GC_ENCRYPT": "0"})


STORE_SCRIPT = """
import json, subprocess, sys, torch.distributed as dist
from bps_gc.collective.rendezvous import collective_config, connect
{store}
port = sys.argv[1]
print(json.dumps([l.split()[3] for l in subprocess.run(["ss", "-ltnH"], capture_output=True,
      text=True).stdout.splitlines() if l.split()[3].endswith(":" + port)]))
"""


def listening(store_code, port):
    script = STORE_SCRIPT.format(store=store_code)
    env = job_env({"DMLC_NUM_WORKER": "1", "DMLC_WORKER_ID": "0", "DMLC_PS_ROOT_URI": "127.0.0.1",
                   "DMLC_PS_ROOT_PORT": str(port), "BPS_GC_TRANSPORT": "collective"})
    result = subprocess.run([sys.executable, "-c", script, str(port)], env=env, capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@needs_ss
def test_the_store_listens_on_the_rendezvous_address_only():
    port = free_port()
    got = listening("cfg, _, _ = collective_config(); connect(cfg, 'gloo')", port)
    assert got == [f"127.0.0.1:{port}"], got


@needs_ss
def test_torch_alone_would_listen_on_every_interface():
    """Why the store is given its own socket: torch 2.13's TCPStore binds every interface
    whatever host it is given (docs/settings.md says so; if torch changes, this fails)."""
    port = free_port()
    got = listening(f"import datetime; s = dist.TCPStore('127.0.0.1', {port}, 1, is_master=True, "
                    "wait_for_workers=False, timeout=datetime.timedelta(seconds=10))", port)
    assert got and all(not address.startswith("127.0.0.1:") for address in got), got


@needs_ss
def test_torchrun_agent_store_listens_on_every_interface(tmp_path):
    """Under torchrun the store is its agent's, beyond bps_gc's reach: docs/settings.md says it
    listens on every interface even with --master-addr 127.0.0.1; this checks that it is so."""
    script = tmp_path / "job.py"
    script.write_text("import json, os, subprocess\np = os.environ['MASTER_PORT']\n"
                      "print(json.dumps([l.split()[3] for l in subprocess.run(['ss', '-ltnH'], capture_output=True, "
                      "text=True).stdout.splitlines() if l.split()[3].endswith(':' + p)]))\n")
    result = subprocess.run(torchrun_argv([str(script)], 1, port=free_port()), env=job_env(),
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got and all(not address.startswith("127.0.0.1:") for address in got), got


def bound(ctx, host, token=None):
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if token:
        sock.plain_server = True
    sockets.bind(sock, host, 0, 1024, "test socket")
    return sock


def test_ps_warns_once_when_listening_beyond_loopback_without_token(monkeypatch, caplog):
    monkeypatch.setattr(sockets, "_warned_open", [])
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger=sockets.__name__):
            opened = [bound(ctx, "127.0.0.1"), bound(ctx, "localhost"), bound(ctx, "127.0.0.1", token="t")]
            assert not caplog.records  # loopback: no warning
            opened += [bound(ctx, "0.0.0.0", token="t")]
            assert not caplog.records  # a token: no warning
            opened += [bound(ctx, "0.0.0.0"), bound(ctx, "0.0.0.0")]
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1, warnings
        assert "listening on 0.0.0.0:" in warnings[0] and "no BPS_GC_AUTH_TOKEN" in warnings[0]
        for sock in opened:
            sock.close()
    finally:
        ctx.term()


@pytest.mark.parametrize("token", [None, "s3cret"], ids=["no-token", "token"])
def test_a_scheduler_on_every_interface_warns_once_without_a_token(token):
    """A real scheduler process (bpslaunch, DMLC_ROLE=scheduler) bound to 0.0.0.0: one warning
    line without a token, none with one (it then gives up waiting for the missing nodes)."""
    env = dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH, DMLC_ROLE="scheduler", DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1",
               DMLC_PS_ROOT_URI="0.0.0.0", DMLC_PS_ROOT_PORT=str(free_port()), BPS_GC_JOIN_TIMEOUT="1")
    env.pop("BPS_GC_AUTH_TOKEN", None)
    if token:
        env["BPS_GC_AUTH_TOKEN"] = token
    result = subprocess.run([sys.executable, "-m", "bps_gc.launcher.cli"], env=env, capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    out = result.stdout + result.stderr
    assert "did not assemble" in out, out[-3000:]  # it did start and listen
    warnings = [line for line in out.splitlines() if "with no BPS_GC_AUTH_TOKEN" in line]
    assert len(warnings) == (0 if token else 1), out[-3000:]
    assert token or "listening on 0.0.0.0:" in warnings[0]


def test_an_address_not_of_this_host_falls_back_with_a_warning(caplog):
    from bps_gc.collective.security import store_listener
    with caplog.at_level(logging.WARNING, logger="bps_gc.collective.security"):
        assert store_listener("192.0.2.1", free_port()) is None  # TEST-NET-1: never a local address
    assert any("192.0.2.1 is not one of this host's" in r.getMessage() for r in caplog.records)
