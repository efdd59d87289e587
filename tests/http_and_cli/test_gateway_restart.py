"""`kvmem serve` as a real process: config from flags > env > TOML; SIGTERM flushes; a restart serves from disk.

The restart's start-up log, piped, shows the model's load and the cache restored ahead as plain lines.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import openai
from conftest import models_dir
from serve_process import ServeProcess, kvmem_serve

KEY = "restart-secret"


def _kvmem_serve(cache_dir: Path, config_file: Path) -> AbstractContextManager[ServeProcess]:
    env = {**os.environ, "KVMEM_HOME": str(models_dir().parent), "KVMEM_PORT": "0", "KVMEM_API_KEY": KEY}
    return kvmem_serve("--model", "tiny-llama", "--cache-dir", str(cache_dir), "--config", str(config_file), env=env)


def test_sigterm_flushes_and_a_restarted_server_serves_the_agent_from_disk(tmp_path: Path) -> None:
    config = tmp_path / "kvmem.toml"
    # TOML < env < flags: the flag's model and the env's port and key win; the TOML's limit applies
    config.write_text('[serve]\nmodel = "tiny-qwen2"\nport = 1\nmax_tokens_limit = 64\n')
    caches = tmp_path / "caches"
    messages: list[dict] = [{"role": "system", "content": "You remember things."},
                            {"role": "user", "content": "My name is Ada. Remember it."}]

    with _kvmem_serve(caches, config) as server:
        url, log = server.url, server.log
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
    with _kvmem_serve(caches, config) as server:
        url = server.url
        # Its start, piped: plain lines (no \r) for the model's load and the cache restored ahead of its turn.
        start = [line.rstrip("\n") for line in server.log]
        assert not any("\r" in line or "\033" in line for line in start), start
        # A slow load (a GPU's first kernels) adds progress lines ("kvmem: loading tiny-llama: 5.0 s") between.
        loads = [line for line in start if not line.startswith("kvmem: loading tiny-llama: ")]
        assert loads[0] == "kvmem: loading tiny-llama ..." and loads[1].startswith("kvmem: loaded tiny-llama in ")
        assert "kvmem: restoring caches ahead ..." in start
        assert any(line.startswith("kvmem: restored 1 of 1 caches ahead in ") for line in start), start
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
