"""A one-line join: another machine's engine connects out to this lab and becomes its next rank.

``join_command(cluster)`` (notebook side) prints ``python -m labkit join TOKEN``.
The token is ipyparallel's engine connection info (controller address, ports,
message-signing key, CurveZMQ server key when encryption is on), so whoever
holds it can run code in the lab: share it like a password.

``run_joined_engine(token)`` (the joining machine) starts a plain ipyparallel
engine with that info in its environment. The engine connects out to the
controller, so the joining machine opens no port for it; gloo and nccl do open
ports between ranks, which every host must reach. ipyparallel's nanny runs
beside the engine, so the lab can interrupt or stop it like any other rank.
The engine becomes a rank at the lab's next ``start`` or ``heal``; it ends when
the lab stops, when the lab is gone for ~10 s, or on Ctrl-C here. The command's
temporary folder goes with it (Ctrl-C, SIGTERM, SIGHUP); after a SIGKILL, the
next join command or lab started on the machine removes it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from labkit.cluster.workdir import remove_stale_workdirs, write_owner
from labkit.spec.errors import LabConfigError
from labkit.spec.network import LOOPBACK_ADDRESS, ipv4_addresses
from labkit.wire.entry import STARTUP_COMMAND

REGISTRATION_SECONDS = 20.0  # a controller across a network may answer slowly; a stale command fails then
REGISTRATION_FAILED = 255  # ipyparallel's engine exits so when the controller never answered
# Past the controller's ~2.4 s without heartbeats: it dropped a frozen engine, which can never be a rank again.
FROZEN_SECONDS = 5.0


def encode_token(connection: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(connection, separators=(",", ":")).encode()).decode()


def decode_token(token: str) -> dict:
    try:
        connection = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, UnicodeError):
        raise LabConfigError("this is not a lab's join token: copy the whole command that %lab join-command "
                             "printed") from None
    if not isinstance(connection, dict) or "registration" not in connection:
        raise LabConfigError("this join token has no controller address: copy the whole command that "
                             "%lab join-command printed")
    return connection


def join_command(cluster, python: str = "python") -> str:
    """The command that makes another machine's engine join the lab run by ``cluster``."""
    return f"{python} -m labkit join {encode_token(cluster.engine_connection())}"


def reach_note(cluster) -> str | None:
    """Who can run the join command: on a loopback lab, only this machine, and what to change."""
    if cluster.plan.controller_address != LOOPBACK_ADDRESS:
        return None
    others = ", ".join(address for addresses in ipv4_addresses().values() for address in addresses
                       if not address.startswith("127.")) or "none"
    return ("this lab's controller listens on loopback, so only processes on this machine can join; for other "
            "machines start the lab with controller_address set to this machine's address on the network they "
            f"share (Lab(controller_address=...), %lab start --controller-address ...; this machine has: {others})")


def engine_command(profile_dir: str) -> list[str]:
    return [sys.executable, "-m", "ipyparallel.engine", f"--profile-dir={profile_dir}",
            "--IPEngine.enable_nanny=True", f"--IPEngine.startup_command={STARTUP_COMMAND}",
            f"--IPEngine.timeout={REGISTRATION_SECONDS}", "--log-level=WARN"]


def _end_with_parent() -> None:
    """In the engine, before it runs: the kernel sends it SIGTERM when the join command dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _wait_ending_frozen(process: subprocess.Popen) -> int:
    """Wait for the engine to end; one frozen (SIGSTOP) for ``FROZEN_SECONDS`` is ended: the lab dropped it, and
    frozen it would never leave, nor would this command. Its exit code."""
    import psutil

    stopped_since = None
    while True:
        try:
            return process.wait(0.5)
        except subprocess.TimeoutExpired:
            pass
        try:
            stopped = psutil.Process(process.pid).status() == psutil.STATUS_STOPPED
        except psutil.Error:
            stopped = False
        if not stopped:
            stopped_since = None
        elif stopped_since is None:
            stopped_since = time.monotonic()
        elif time.monotonic() - stopped_since >= FROZEN_SECONDS:
            print(f"labkit: the engine was frozen for {FROZEN_SECONDS:g} s (the lab has dropped it): ending it",
                  flush=True)
            process.kill()
            stopped_since = None


def run_joined_engine(token: str, interface: str | None = None) -> int:
    """Run an engine that joins the lab of ``token`` until it ends; its exit code."""
    connection = decode_token(token)
    remove_stale_workdirs()  # the folders of join commands (and labs) killed with SIGKILL here before
    profile_dir = tempfile.mkdtemp(prefix="labkit-join-")  # private (0700), removed at the end
    write_owner(profile_dir)  # stale once this command is gone, however it went
    env = dict(os.environ, IPP_CONNECTION_INFO=json.dumps(connection), LABKIT_SLOT="joined")
    if interface:
        env["LABKIT_INTERFACE"] = interface
    where = f"{connection.get('interface', 'tcp://?')}:{connection['registration']}"
    print(f"labkit: joining the lab at {where}; this engine becomes a rank at the lab's next start or heal. "
          "Ctrl-C leaves.", flush=True)
    # The engine (and its nanny) stay in this command's process group, and get SIGTERM if this command
    # is killed: ending the join command, however it ends, ends the engine.
    process = subprocess.Popen(engine_command(profile_dir), env=env, preexec_fn=_end_with_parent)
    leave = lambda _signum, _frame: process.terminate()  # noqa: E731 - Ctrl-C: the engine leaves the lab
    # Ctrl-C, kill, and the terminal closing (SIGHUP) all end the engine and remove the folder below.
    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = _wait_ending_frozen(process)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(profile_dir, ignore_errors=True)
    print(f"labkit: the engine left the lab (exit code {code})", flush=True)
    if code == REGISTRATION_FAILED:
        print(f"labkit: it could not register at {where} within {REGISTRATION_SECONDS:g} s: the lab stopped or "
              "restarted (a join command is good for one lab run: print a new one), that address cannot be reached "
              "from here, or the lab is encrypted and this is not its command", flush=True)
    return code
