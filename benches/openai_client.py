"""A streaming OpenAI Chat Completions client that times what a user sees.

Used to send the very same requests to ``kvmem serve`` and to other servers
that speak the same API (``mlx_lm.server``): TTFT is the time to the first
non-empty content delta, E2E the time to the end of the stream, and the
server's own ``usage`` (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``,
``completion_tokens``) comes from the ``include_usage`` chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class StreamedCompletion:
    """One streamed chat completion as the client saw it."""

    ttft_ms: float
    e2e_ms: float
    text: str
    prompt_tokens: int
    cached_tokens: int | None  # None: the server does not report it
    completion_tokens: int


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, str]],
    *,
    max_tokens: int,
    model: str = "default",
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> StreamedCompletion:
    """POST ``/v1/chat/completions`` with ``stream: true`` (greedy) and time it.

    ``extra`` adds server-specific body fields (llama.cpp's ``id_slot``, ``cache_prompt``).
    """
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers or {},
                             timeout=None) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {resp.text[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content") or ""
                if content:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(content)
    t1 = time.perf_counter()
    first = first if first is not None else t1
    details = usage.get("prompt_tokens_details")
    return StreamedCompletion(
        ttft_ms=(first - t0) * 1e3,
        e2e_ms=(t1 - t0) * 1e3,
        text="".join(parts),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0) if isinstance(details, dict) else None,
        completion_tokens=int(usage.get("completion_tokens", 0)),
    )
