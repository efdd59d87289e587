"""The race's single-agent section: cold, hot and after a restart at each context size; KV bytes on disk per token.

Per contender, context size C and repeat, on a server started for it alone:

1. a throwaway request (first-request costs, and mlx-lm's model load, stay out
   of the measured turns);
2. **cold** — a new conversation in the server's own tokenizer (corpus text
   sized with :func:`benches.prompts.sized_text`, then a question), sized so
   that the whole conversation, turn 3's reply included, fits in C tokens
   (:func:`reserve`);
3. **hot** — turn 2: the conversation, the reply, a new question;
4. the server is restarted: SIGTERM, started again (kvmem on the same cache
   folder), ready when its readiness check answers (kvmem ``/healthz``,
   llama-server ``/health``); llama.cpp + slot files saves its slot before the
   stop and restores it after the start;
5. **after restart** — turn 3, sent at once (mlx_lm.server first gets a
   throwaway request: it loads its model on the first one). The user-facing
   TTFT is the slot restore (if any) plus the request's TTFT.

The hot and after-restart questions have the same token count. KV bytes on
disk per token: what kvmem's cache folder grew by for the conversation through
turn 2, over the tokens the agent's cache holds; llama.cpp's slot file, over
the tokens it holds (``n_saved``).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import trio

from benches.harness import ResultFile, log, median, table
from benches.openai_client import StreamedCompletion, stream_chat
from benches.prompts import sized_text
from benches.peers.race_servers import KVMEM, LLAMA, LLAMA_SLOTS, MLX_LM, Contender, Running, Setup

FIRST, HOT_Q, AFTER_Q = "Summarize the notes.", "Where did they go next?", "What did the letter say?"
WARM_UP = [{"role": "user", "content": "Hello there."}]
#: Tokens the chat template adds around the first message (SmolLM2's default system prompt, role markers, question).
TEMPLATE_TOKENS = 40
#: Tokens a later question adds with its role markers.
QUESTION_TOKENS = 20
ON_DISK = {KVMEM: "Q4 KV blocks (cache folder)", LLAMA_SLOTS: "slot file (f16 K and V, llama.cpp's default)",
           LLAMA: "none: prompts kept in RAM (`--cache-ram`), lost on restart",
           MLX_LM: "none: in-memory prompt cache, lost on restart"}


@dataclass(frozen=True)
class SingleRun:
    """One contender's three turns at one context size, with the restart between turns 2 and 3."""

    contender: str
    context: int
    repeat: int
    cold: StreamedCompletion
    hot: StreamedCompletion
    after: StreamedCompletion
    restart_s: float
    save_ms: float
    restore_ms: float
    disk_bytes: int
    disk_tokens: int

    @property
    def after_user_ms(self) -> float:
        """What a user waits once the restarted server is ready: the slot restore (if any), then the TTFT."""
        return self.restore_ms + self.after.ttft_ms


def reserve(tokens: int) -> int:
    """What a conversation of C tokens leaves to template, questions and replies: turn 3 with its reply fits in C.

    llama-server caps a slot at the model's training context (8192 for
    SmolLM2), so an 8K conversation has to fit in 8192 tokens, replies included.
    """
    return TEMPLATE_TOKENS + 2 * QUESTION_TOKENS + 3 * tokens


def _chat(running: Running, messages: list[dict[str, str]], agent: str, max_tokens: int) -> StreamedCompletion:
    async def go() -> StreamedCompletion:
        async with httpx.AsyncClient() as client:
            return await stream_chat(client, running.url, messages, max_tokens=max_tokens, model=running.model,
                                     headers=running.headers(agent), extra=running.body(0))

    return trio.run(go)


def measure(contender: Contender, setup: Setup, context: int, repeat: int, *, tokens: int,
            res: ResultFile) -> SingleRun:
    """Cold, hot, restart, after restart for one contender at ``context`` tokens (its own server, stopped after)."""
    agent = f"race-{context}-r{repeat}"
    running = contender.launch(setup, f"single-{context}-r{repeat}", slot_ctx=context + 1024)
    running.start()
    try:
        _chat(running, WARM_UP, "race-warm-up", 2)
        if contender.engine == KVMEM:
            running.wait_saved("race-warm-up")
        before = running.disk_bytes()
        text = sized_text(running.count_tokens, context - reserve(tokens), label=agent, offset=repeat * 7919 + context)
        messages = [{"role": "user", "content": f"{text}\n\n{FIRST}"}]
        cold = _chat(running, messages, agent, tokens)
        messages += [{"role": "assistant", "content": cold.text}, {"role": "user", "content": HOT_Q}]
        hot = _chat(running, messages, agent, tokens)
        messages += [{"role": "assistant", "content": hot.text}, {"role": "user", "content": AFTER_Q}]
        disk_tokens, disk = 0, 0
        if contender.engine == KVMEM:
            disk_tokens = int(running.wait_saved(agent)["cached_tokens"])
            disk = running.disk_bytes() - before
        restart_s = running.restart()
        if running.loads_lazily:
            _chat(running, WARM_UP, "race-warm-up", 2)
        after = _chat(running, messages, agent, tokens)
        if running.saves:
            disk_tokens, disk = int(running.saves[0]["n_saved"]), running.disk_bytes()
    finally:
        running.stop()
    run = SingleRun(contender.name, context, repeat, cold, hot, after, restart_s, 1e3 * running.save_s,
                    1e3 * running.restore_s, disk, disk_tokens)
    for state, turn in (("cold", cold), ("hot", hot), ("after restart", after)):
        res.record(section="single", contender=contender.name, context=context, repeat=repeat, state=state,
                   ttft_ms=turn.ttft_ms, e2e_ms=turn.e2e_ms, prompt_tokens=turn.prompt_tokens,
                   cached_tokens=turn.cached_tokens, completion_tokens=turn.completion_tokens)
    res.record(section="single", contender=contender.name, context=context, repeat=repeat, state="restart",
               restart_s=restart_s, save_ms=run.save_ms, restore_ms=run.restore_ms, disk_bytes=disk,
               disk_tokens=disk_tokens, slot_saves=running.saves, slot_restores=running.restores)
    log(f"single {contender.name} C={context} r{repeat}: cold {cold.ttft_ms:.0f} ms, hot {hot.ttft_ms:.0f} ms, "
        f"after restart {run.after_user_ms:.0f} ms (restore {run.restore_ms:.0f} ms; cached "
        f"{after.cached_tokens}/{after.prompt_tokens}), restart {restart_s:.1f} s")
    return run


def medians(runs: list[SingleRun]) -> dict[tuple[str, int], dict[str, float]]:
    """Per (contender, context): median TTFTs (ms) cold / hot / after (user-facing) / restore, and bytes per token."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for key in dict.fromkeys((r.contender, r.context) for r in runs):
        mine = [r for r in runs if (r.contender, r.context) == key]
        out[key] = {
            "cold": median(r.cold.ttft_ms for r in mine), "hot": median(r.hot.ttft_ms for r in mine),
            "after": median(r.after_user_ms for r in mine), "restore": median(r.restore_ms for r in mine),
            "restart_s": median(r.restart_s for r in mine), "prompt": median(r.cold.prompt_tokens for r in mine),
            "after_prompt": median(r.after.prompt_tokens for r in mine),
            "after_cached": median(r.after.cached_tokens or 0 for r in mine),
            "bytes_per_token": median(r.disk_bytes / r.disk_tokens if r.disk_tokens else 0.0 for r in mine),
            "disk_tokens": median(r.disk_tokens for r in mine), "disk_bytes": median(r.disk_bytes for r in mine),
        }
    return out


def report(res: ResultFile, runs: list[SingleRun], reps: int) -> None:
    """The single-agent table and the KV-bytes-on-disk table."""
    med = medians(runs)
    rows = []
    for (name, c), m in sorted(med.items(), key=lambda kv: (kv[0][1], list(ON_DISK).index(kv[0][0]))):
        restore = f" (restore {m['restore']:.0f})" if name == LLAMA_SLOTS else ""
        rows.append([f"{c // 1024}K", name, f"{m['prompt']:.0f}", f"{m['cold']:.0f}", f"{m['hot']:.0f}",
                     f"{m['after']:.0f}{restore}", f"{m['after'] / m['hot']:.2f}", f"{m['cold'] / m['after']:.1f}x",
                     f"{m['after_cached']:.0f} / {m['after_prompt']:.0f}", f"{m['restart_s']:.1f}"])
    disk_rows = []
    for name, what in ON_DISK.items():
        mine = [(c, m) for (n, c), m in sorted(med.items()) if n == name]
        if mine:
            per = " / ".join(f"{m['bytes_per_token']:,.0f}" for _, m in mine)
            sizes = " / ".join(f"{m['disk_bytes'] / 2**20:.1f} MiB for {m['disk_tokens']:.0f}" for _, m in mine)
            disk_rows.append([name, per, sizes if any(m["disk_bytes"] for _, m in mine) else "—", what])
    res.body += [
        "## Single agent: cold, hot, after a restart", "",
        *table(["context", "server", "cold prompt tok (own tokenizer)", "cold TTFT ms", "hot TTFT ms",
                "after-restart TTFT ms (user-facing)", "after / hot", "cold / after",
                "cached / prompt tok after restart", "restart s (to ready)"], rows),
        "",
        f"Medians of {reps} repeat(s). A conversation of C tokens holds, with turn 3's reply, at most C tokens "
        "(llama-server caps a slot at the model's 8192-token training context). *after-restart TTFT* is the first "
        "request sent once the restarted server answered its readiness check; for llama.cpp + slot files it "
        "includes restoring the slot file (in parentheses). *cached / prompt tok* is the server's own `usage` "
        "for that request. The hot and after-restart questions have the same token count.",
        "",
        "## KV bytes on disk per token", "",
        *table(["server", "bytes per token (" + " / ".join(f"{c // 1024}K" for c in sorted({c for _, c in med}))
                + ")", "on disk", "what"], disk_rows, align="lrrl"),
        "",
        "kvmem: what its cache folder grew by for the conversation (through turn 2's reply) over the tokens the "
        "agent's cache holds (`GET /v1/agents/{id}`); llama.cpp: the slot file over the tokens it holds "
        "(`n_saved`). mlx_lm.server and llama.cpp's built-in cache keep nothing on disk (0).",
        "",
    ]
