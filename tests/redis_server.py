"""A real ``redis-server`` on a free loopback port, for the shared-tier tests (skipped where it cannot run).

Optionally password-protected (``--requirepass``) or TLS-only (``--tls-port``,
with a throwaway CA and server certificate made by ``openssl``; skipped where
the server or ``openssl`` lacks TLS).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import models_dir

from actors import open_runtime

__all__ = ["RedisServer", "TlsFiles", "make_tls_files", "redis_server", "open_node", "second_turn", "MESSAGES"]

MESSAGES = [{"role": "system", "content": "You are a storyteller who remembers."},
            {"role": "user", "content": "Tell me about the lighthouse keeper and her cat."}]
"""The first turn the shared-tier tests give an agent."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_tls_files(folder: Path, *, name: str = "ca") -> TlsFiles:
    """Make a CA and a server certificate (``IP:127.0.0.1``) in ``folder`` with ``openssl``; skip if it cannot."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = folder / f"{name}.key", folder / f"{name}.crt"
    key, csr, cert, ext = (folder / f"{name}-server.{s}" for s in ("key", "csr", "crt", "ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for command in (
        [openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca_cert, "-days", "1", "-subj", f"/CN=kvmem {name}"],
        [openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "1", "-extfile", ext],
    ):
        done = subprocess.run([str(c) for c in command], capture_output=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"openssl could not make a test certificate: {done.stderr.decode(errors='replace')[-200:]}")
    return TlsFiles(ca_cert=ca_cert, server_cert=cert, server_key=key)


class RedisServer:
    """One ``redis-server`` (no persistence) in ``workdir``; :meth:`stop`, then :meth:`start` on the same port.

    Args:
        workdir: its working folder.
        password: ``--requirepass``: clients must authenticate.
        tls: serve TLS only, with these certificates (no client certificates asked).
    """

    def __init__(self, workdir: Path, *, password: str | None = None, tls: TlsFiles | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.port = _free_port()
        self.password = password
        self.tls = tls
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL a client uses: with the password, and for TLS the CA to verify the server with."""
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        query = urllib.parse.urlencode({"ssl_cert_reqs": "required", "ssl_ca_certs": str(self.tls.ca_cert)})
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{query}"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def start(self) -> None:
        args = [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.server_cert),
                     "--tls-key-file", str(self.tls.server_key), "--tls-ca-cert-file", str(self.tls.ca_cert),
                     "--tls-auth-clients", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.skip(f"redis-server could not start (exit {self.process.returncode})")
            try:
                if self.client().ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        self.stop()
        pytest.skip("redis-server did not answer within 10 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh ``redis-server`` for one test."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def open_node(home: Path, store: str | None, **kw: Any):  # noqa: ANN201 - open_runtime's context manager
    """One in-process node (a runtime on ``tiny-llama``) against ``store``."""
    return open_runtime(model="tiny-llama", home=home, models_dir=models_dir(), fsync=False, store=store,
                        handle_signals=False, **kw)


def second_turn(reply: str) -> list[dict[str, str]]:
    """:data:`MESSAGES`, the agent's ``reply`` and a follow-up question."""
    return [*MESSAGES, {"role": "assistant", "content": reply}, {"role": "user", "content": "What was her name?"}]
