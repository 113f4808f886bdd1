"""End to end through vLLM's OpenAI-compatible online server: ``vllm.entrypoints.openai.
api_server`` (AsyncLLM, the engine core in its own process) with kvtier's connector and a
real daemon, driven over HTTP as clients drive it.

One server serves the whole module (its start costs ~30 s here), and one first wave of
concurrent streaming chats gives every test its reference tokens: the same chats reloaded
from kvtier after vLLM's own prefix cache is reset, a ``cache_salt`` that must not share
the unsalted KV, and clients that disconnect mid-stream, after which nothing may be left
held. Cached tokens are read from ``usage.prompt_tokens_details`` (the server runs with
``--enable-prompt-tokens-details``), token ids from ``return_token_ids``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import REPO
from tests.e2e.vllm_engine import (
    BLOCK_SIZE,
    ENGINE_ENV,
    TOKENS_PER_BLOCK,
    VOCAB,
    build_tiny_llama,
    kv_transfer_config,
    prompt,
)
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

MODEL = "tiny-online"
START_TIMEOUT_S = 240
SETTLE_S = 30            # deadline for what the server and the daemon do after a reply
MAX_MODEL_LEN = 4096     # the tiny model's max_position_embeddings
MAX_TOKENS = 12
PREFIX = 4 * TOKENS_PER_BLOCK                # shared by every prompt: 4 kvtier blocks
SUFFIX = 100                                 # each prompt's own tail
FULL_BLOCKS_TOKENS = (PREFIX + SUFFIX) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK   # 320
N_PROMPTS = 8


def words(seed: int, n: int) -> list[int]:
    """Token ids of the tokenizer's plain words (3.., never <unk>, <s>, </s>)."""
    return [t if t >= 3 else t + 3 for t in prompt(seed, n)]


SHARED = words(500, PREFIX)
PROMPTS = [SHARED + words(600 + i, SUFFIX) for i in range(N_PROMPTS)]


def text_of(ids: list[int]) -> str:
    return " ".join(f"w{t}" for t in ids)


def add_word_tokenizer(path: Path) -> Path:
    """A whitespace word-level tokenizer (``w<id>`` is token ``id``) with a chat template
    that renders the messages' contents only, saved beside the model: a chat's prompt
    tokens are then exactly the words sent (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll(what: str, probe: Callable[[], Any], ok: Callable[[Any], bool],
         timeout: float = SETTLE_S, tail: Callable[[], str] = lambda: "") -> Any:
    """``probe()`` until ``ok`` of it, or an AssertionError naming ``what`` and the last
    value seen past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"{what}: last {value!r}\n{tail()}"
        time.sleep(0.1)


@dataclass
class Chat:
    prompt_ids: list[int]
    tokens: list[int]
    cached: int | None      # usage.prompt_tokens_details.cached_tokens


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group."""

    def __init__(self, work: Path, model: Path, daemon: DaemonProcess) -> None:
        self.port = free_port()
        self.log_path = work / "server.log"
        transfer = kv_transfer_config(daemon.socket, model_id=MODEL)
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model), "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
                "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--enable-server-load-tracking",         # /load: requests the API server holds
                "--disable-access-log-for-endpoints", "/health,/metrics,/load",
                "--kv-transfer-config", json.dumps(transfer)]
        env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1",   # the engine core in its own process
               "VLLM_SERVER_DEV_MODE": "1"}             # for /reset_prefix_cache
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pgid = self.proc.pid

    def tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- server log tail ---\n{text[-6000:]}"

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, (
                f"the server exited (rc={self.proc.returncode})\n{self.tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self.request("GET", "/health", timeout=2)[0] == 200:
                    return
            assert time.monotonic() < deadline, (
                f"no /health in {START_TIMEOUT_S} s\n{self.tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM the whole group, SIGKILL what is left after 15 s, and wait until no
        process of the group (the engine core included) is alive."""
        for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(0.05)   # reap the leader, or it stays a zombie
                try:
                    os.killpg(self.pgid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)
        raise AssertionError(f"processes of group {self.pgid} outlived SIGKILL")

    def request(self, method: str, path: str, body: Any = None,
                timeout: float = 60) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus samples, by name with labels."""
        status, body = self.request("GET", "/metrics")
        assert status == 200, f"/metrics: {status}\n{self.tail()}"
        samples: dict[str, float] = {}
        for line in body.decode().splitlines():
            m = re.match(r"^(vllm:[^\s{]+)(\{[^}]*\})? (\S+)$", line)
            if m:
                name = m.group(1) + re.sub(r',?(engine|model_name)="[^"]*"', "",
                                           m.group(2) or "").replace("{,", "{")
                samples[name.replace("{}", "")] = float(m.group(3))
        return samples

    def requests_in_engine(self) -> tuple[float, float]:
        """vLLM's running and waiting requests."""
        m = self.metrics()
        return m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]

    def in_flight(self) -> int:
        """The chats the API server is still handling (``/load``: a stream counts until
        it ended, or until its disconnect was seen and the request aborted)."""
        status, body = self.request("GET", "/load")
        assert status == 200, f"/load: {status}\n{self.tail()}"
        return int(json.loads(body)["server_load"])

    def reset_prefix_cache(self) -> None:
        """vLLM's own prefix cache only (not the connector's: that would change the
        namespace); retried while pages are still held (a save not yet acknowledged)."""
        poll("reset_prefix_cache", lambda: self.request("POST", "/reset_prefix_cache"),
             lambda r: r[0] == 200 and json.loads(r[1]) == {"success": True},
             tail=self.tail)

    def open_chat(self, ids: list[int], max_tokens: int, **extra: Any) \
            -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text_of(ids)}],
                "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                "return_token_ids": True, **extra}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read()[:2000]
            conn.close()
            raise AssertionError(f"chat: HTTP {resp.status}: {detail!r}\n{self.tail()}")
        return conn, resp

    def chat(self, ids: list[int], max_tokens: int = MAX_TOKENS, **extra: Any) -> Chat:
        """One streaming chat, read to its end."""
        conn, resp = self.open_chat(ids, max_tokens, **extra)
        try:
            prompt_ids: list[int] = []
            tokens: list[int] = []
            cached = None
            done = False
            for event in events(resp):
                if event is None:
                    done = True
                    break
                prompt_ids += event.get("prompt_token_ids") or []
                for choice in event.get("choices") or []:
                    tokens += choice.get("token_ids") or []
                usage = event.get("usage")
                if usage:
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            assert done, f"the stream ended without [DONE]\n{self.tail()}"
            return Chat(prompt_ids, tokens, cached)
        finally:
            conn.close()


def events(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any] | None]:
    """The JSON of each server-sent event of a stream; None for its ``[DONE]``."""
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield None
            return
        event = json.loads(data)
        assert "error" not in event, f"error in stream: {event}"
        yield event


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, daemon: DaemonProcess) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("online")
    model = add_word_tokenizer(build_tiny_llama(work / "model"))
    srv = Server(work, model, daemon)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def stats_of(daemon: DaemonProcess) -> dict[str, Any]:
    s = daemon.stats()
    return {"hit_blocks": s["requests"]["hit_blocks"], "get_blocks": s["requests"]["get_blocks"],
            "loaded_blocks": s["connector"].get("loaded_blocks", 0),
            "namespaces": s["namespaces"], "leases": s["leases"]["active"],
            "quarantined": s["leases"]["quarantined_slots"],
            "lease_expired": s["requests"]["lease_expired"]}


def wave(server: Server) -> list[Chat]:
    """Every prompt at once, each on its own streaming connection."""
    with ThreadPoolExecutor(N_PROMPTS) as pool:
        return list(pool.map(server.chat, PROMPTS))


@pytest.fixture(scope="module")
def first_wave(server: Server) -> list[Chat]:
    """The first wave (nothing in kvtier yet): the reference tokens of every prompt."""
    first = wave(server)
    for chat, ids in zip(first, PROMPTS, strict=True):
        assert chat.prompt_ids == ids, "the chat template or tokenizer changed the prompt"
        assert len(chat.tokens) == MAX_TOKENS
    # the tokens depend on the prompt (else equal outputs would prove nothing)
    assert len({tuple(c.tokens) for c in first}) > 1, [c.tokens for c in first]
    return first


def test_second_wave_loads_from_kvtier_with_the_same_tokens(
        server: Server, daemon: DaemonProcess, first_wave: list[Chat]) -> None:
    server.reset_prefix_cache()
    before, metrics0 = stats_of(daemon), server.metrics()
    second = wave(server)
    assert [c.tokens for c in second] == [c.tokens for c in first_wave], server.tail()
    # every full kvtier block of each prompt is cached: loaded from kvtier, or (for the
    # shared prefix of a prompt admitted beside or after another) from the pages vLLM's
    # prefix cache got from that load
    assert [c.cached for c in second] == [FULL_BLOCKS_TOKENS] * N_PROMPTS, server.tail()
    after = stats_of(daemon)
    assert after["hit_blocks"] - before["hit_blocks"] >= FULL_BLOCKS_TOKENS // TOKENS_PER_BLOCK
    assert after["get_blocks"] > before["get_blocks"]
    metrics1 = server.metrics()
    external = (metrics1["vllm:external_prefix_cache_hits_total"]
                - metrics0["vllm:external_prefix_cache_hits_total"])
    assert external >= FULL_BLOCKS_TOKENS, (external, server.tail())
    # the connector's own count reaches the daemon within its 1 s report period
    poll("connector loaded_blocks", lambda: stats_of(daemon)["loaded_blocks"],
         lambda n: n > before["loaded_blocks"], tail=server.tail)


def test_a_cache_salt_shares_nothing(server: Server, daemon: DaemonProcess,
                                     first_wave: list[Chat]) -> None:
    expected = first_wave[0].tokens
    before = stats_of(daemon)
    salted = server.chat(PROMPTS[0], cache_salt="tenant-b")
    assert salted.tokens == expected, server.tail()
    assert salted.cached == 0, server.tail()
    assert stats_of(daemon)["hit_blocks"] == before["hit_blocks"]
    # ... and its KV went to kvtier under a namespace of its own
    poll("the salted namespace", lambda: stats_of(daemon)["namespaces"],
         lambda n: n > before["namespaces"], tail=server.tail)


def test_clients_disconnecting_mid_stream_leave_nothing_held(
        server: Server, daemon: DaemonProcess, first_wave: list[Chat]) -> None:
    # a long decode, dropped after a few tokens
    seen, generated = drop_until_aborted(server, PROMPTS[1], read=3)
    assert seen <= generated < LONG, (seen, generated, server.tail())
    # one dropped before its first token (its prompt to be loaded from kvtier)
    _, generated = drop_until_aborted(server, PROMPTS[2], read=0, reset=True)
    assert generated < LONG, (generated, server.tail())

    # the pages of the aborted requests are free (a delayed free never reported keeps
    # them), and so are the daemon's leases
    poll("vLLM's KV cache usage", lambda: server.metrics()["vllm:kv_cache_usage_perc"],
         lambda u: u == 0, tail=server.tail)
    poll("daemon leases", lambda: stats_of(daemon)["leases"], lambda n: n == 0,
         tail=server.tail)
    after = stats_of(daemon)
    assert (after["quarantined"], after["lease_expired"]) == (0, 0), after

    # the server still answers, with the same tokens, from kvtier's copy
    server.reset_prefix_cache()
    for i in (1, 2, 3):
        chat = server.chat(PROMPTS[i])
        assert chat.tokens == first_wave[i].tokens, (i, server.tail())
        assert chat.cached == FULL_BLOCKS_TOKENS, (i, chat.cached, server.tail())


# max_tokens of the requests dropped mid-stream: all the context left after the prompt
# (vLLM clamps to it), so that a run to the end takes the longest (~30 s on 2 CPUs) and is
# least likely to beat the disconnect
LONG = MAX_MODEL_LEN - (PREFIX + SUFFIX)
DROP_TRIES = 3       # drops of a request until vLLM is seen to abort one
RUN_OUT_S = 180      # deadline for the API server to be done with a dropped request,
                     # a run to LONG included


def finished_requests(metrics: dict[str, float]) -> float:
    """The requests vLLM finished, whatever their ``finished_reason``: a request a client
    aborts is counted under none (``OutputProcessor.abort_requests`` drops its state
    before any stats; ``finished_reason="abort"`` counts only aborts the engine core
    reports itself)."""
    return sum(v for k, v in metrics.items() if k.startswith("vllm:request_success_total"))


def drop_until_aborted(server: Server, ids: list[int], read: int,
                       reset: bool = False) -> tuple[int, int]:
    """A streaming chat of ``ids`` with max_tokens=LONG, dropped once ``read`` of its
    tokens are seen (at once for 0), then waited out of vLLM: ``(tokens seen, tokens
    generated)`` once vLLM aborted it on the disconnect, i.e. it left the engine with no
    request finished (``vllm:request_success_total`` unchanged) and short of LONG.

    vLLM's API server notices a disconnect on its event loop (starlette's
    ``StreamingResponse.listen_for_disconnect``, then ``AsyncLLM.abort``) while the
    engine core, a process of its own, decodes on: on a loaded CPU the API server can be
    starved long enough that the engine runs the request to max_tokens first, and that
    run proves nothing about an abort. So such a run is dropped again, DROP_TRIES times
    in all, and a failure after them says that vLLM never aborted. ``reset`` resets
    vLLM's prefix cache before each drop (the prompt is then loaded from kvtier)."""
    runs: list[tuple[int, float, float]] = []
    for _ in range(DROP_TRIES):
        if reset:
            server.reset_prefix_cache()
        before = server.metrics()
        conn, resp = server.open_chat(ids, max_tokens=LONG)
        seen = 0
        if read:
            for event in events(resp):
                assert event is not None, "the long stream ended before the disconnect"
                seen += sum(len(c.get("token_ids") or []) for c in event.get("choices") or [])
                if seen >= read:
                    break
        drop(conn)
        # the API server is done with it (aborted, or streamed to its end), and then so
        # is the engine (its running gauge alone may be one not yet counting the request)
        poll("chats in flight in the API server", server.in_flight, lambda n: n == 0,
             timeout=RUN_OUT_S, tail=server.tail)
        poll("requests running or waiting", server.requests_in_engine,
             lambda r: r == (0, 0), tail=server.tail)
        after = server.metrics()
        finished = finished_requests(after) - finished_requests(before)
        generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        if finished == 0 and generated < LONG:
            return seen, int(generated)
        runs.append((seen, finished, generated))   # run to its end: not an abort
    raise AssertionError(f"vLLM never aborted a dropped request (seen, finished, generated "
                         f"of each drop): {runs}\n{server.tail()}")


def drop(conn: http.client.HTTPConnection) -> None:
    """Close the client's socket at once, as a client that goes away does."""
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
