"""`kvmem serve` as a real process: config from flags > env > TOML; SIGTERM flushes; a restart serves from disk."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
from conftest import models_dir

ROOT = Path(__file__).resolve().parents[1]
KEY = "restart-secret"


@contextmanager
def _kvmem_serve(cache_dir: Path, config_file: Path) -> Iterator[tuple[str, list[str]]]:
    env = {**os.environ, "KVMEM_HOME": str(models_dir().parent), "KVMEM_PORT": "0", "KVMEM_API_KEY": KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--model", "tiny-llama", "--cache-dir", str(cache_dir),
         "--config", str(config_file)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)

    threading.Thread(target=drain, daemon=True).start()
    try:
        url = None
        while url is None:
            line = lines.get(timeout=120)
            log.append(line)
            found = re.search(r"serving \S+ on (http://\S+)", line)
            url = found.group(1) if found else None
        yield url, log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        while not lines.empty():
            log.append(lines.get())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_flushes_and_a_restarted_server_serves_the_agent_from_disk(tmp_path: Path) -> None:
    config = tmp_path / "kvmem.toml"
    # TOML < env < flags: the flag's model and the env's port and key win; the TOML's limit applies
    config.write_text('[serve]\nmodel = "tiny-qwen2"\nport = 1\nmax_tokens_limit = 64\n')
    caches = tmp_path / "caches"
    messages: list[dict] = [{"role": "system", "content": "You remember things."},
                            {"role": "user", "content": "My name is Ada. Remember it."}]

    with _kvmem_serve(caches, config) as (url, log):
        health = httpx.get(url + "/healthz").json()
        assert health["model"] == "tiny-llama"
        assert httpx.post(url + "/v1/messages", json={}).status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        too_many = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                              json={"model": "tiny-llama", "max_tokens": 65, "messages": messages})
        assert too_many.status_code == 400
        raw = client.chat.completions.with_raw_response.create(model="tiny-llama", max_tokens=8,
                                                               messages=messages, user="returning")
        first = raw.parse()
        assert raw.headers["x-kvmem-tier"] == "cold"
    assert any("caches flushed" in line for line in log), log

    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "What is my name?"}]
    with _kvmem_serve(caches, config) as (url, _log):
        headers = {"x-api-key": KEY}
        info = httpx.get(url + "/v1/agents/returning", headers=headers).json()
        assert info["on_disk"] and not info["hot"] and info["cached_tokens"] > 0
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(model="tiny-llama", max_tokens=8,
                                                               messages=messages, user="returning")
        second = raw.parse()
        assert raw.headers["x-kvmem-tier"] == "warm"
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        cached = second.usage.prompt_tokens_details.cached_tokens or 0
        assert first.usage is not None and cached >= first.usage.prompt_tokens
        assert int(raw.headers["x-kvmem-tokens-prefilled"]) < first.usage.prompt_tokens
