"""A turn on the GPU actor: its state there, and the reports made from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.messages_common import TurnUsage
from actors.messages_gpu import Generate, Generated, Scores, TurnStarted
from actors.metrics import RunningTurn
from runtime.plan.hot_tier import HotDonor
from runtime.plan.engine import Finished, SequenceStarted, TurnStats
from runtime.plan.tools import ToolCall
from runtime.plan.turn_plan import Tier, Tokenized, TurnPlan

__all__ = ["GpuTurn", "generated_reply", "running_turn", "tier_of"]


@dataclass
class GpuTurn:
    """One turn on the GPU actor: its request and what has happened to it so far."""

    msg: Generate
    prompt: str  # rendered
    plan: TurnPlan
    tokens: Tokenized
    admitted_at: float | None = None
    first_token_at: float | None = None
    pending: list[str | ToolCall | Scores] = field(default_factory=list)  # what the client's channel had no room for
    client_gone: bool = False
    adopted: bool = False  # started from a prefix of another agent's turn in flight
    started: SequenceStarted | None = None  # the engine's start, its stats as they were
    announced: TurnStarted | None = None  # what it reuses and prefills (after an adoption), once its prefill begins
    accept_due: bool = False  # a streaming client waits for its TurnAccepted or TurnStarted
    prompt_tokens: int = 0  # what its cache holds once prefilled (reused + new)
    prefilled: int = 0  # progress: prompt tokens through the model so far, and reply tokens delivered
    generated: int = 0
    checked_out: bool = False  # the turn's new cache becomes the agent's (its first sample, with a store)
    leased: bool = False  # the store counts the turn (a shared tier's lease): a Save ends it
    donors: tuple[HotDonor, ...] = field(default=(), repr=False)  # others' hot caches its checkout gave


def tier_of(req: GpuTurn, reused: int) -> Tier:
    """Where a turn's reused cache came from: its plan's tier, ``shared`` after an adoption, ``cold`` if nothing."""
    if not reused:
        return "cold"
    return "shared" if req.adopted else req.plan.tier


def generated_reply(req: GpuTurn, fin: Finished | None, *, model: str, cancelled: bool) -> Generated:
    """The ``Generated`` reply of a turn that left the GPU (``fin``: its engine result; None if it had none;
    ``model``: the loaded model's name). Its usage is the engine's counts and decode rate (:class:`TurnStats`)
    with what only this actor knows: the tier, the wait for admission, the first token's time from submission."""
    submitted = req.msg.submitted_at
    admitted = req.admitted_at if req.admitted_at is not None else time.perf_counter()
    first = req.first_token_at
    stats = fin.stats if fin is not None else TurnStats()
    reason = "cancelled" if cancelled else (fin.finish_reason if fin is not None and fin.finish_reason else "stop")
    return Generated(
        request_id=req.msg.request_id,
        model=model,
        reply=fin.reply if fin is not None else "",
        finish_reason=reason,
        usage=TurnUsage(
            tokens_reused=stats.tokens_reused,
            tokens_prefilled=stats.tokens_prefilled,
            tokens_generated=stats.tokens_generated,
            tier=tier_of(req, stats.tokens_reused),
            match=stats.match,
            queue_wait_ms=max(0.0, admitted - submitted) * 1000.0,
            ttft_ms=max(0.0, first - submitted) * 1000.0 if first is not None else 0.0,
            decode_tps=stats.decode_tps,
        ),
        parked=fin.parked if fin is not None else None,
        stop_sequence=fin.stop_sequence if fin is not None and not cancelled else None,
        content=(fin.reply if fin.content is None else fin.content) if fin is not None else "",
        tool_calls=fin.tool_calls if fin is not None else (),
        logprobs=fin.logprobs if fin is not None else (),
    )


def running_turn(request_id: int, req: GpuTurn) -> RunningTurn:
    """A turn on the GPU right now, with its phase and progress (``/v1/agents``, ``/metrics``)."""
    started = req.announced
    if started is None:
        phase = "queued"
    elif req.prefilled < started.tokens_prefilled:
        phase = "prefill"
    else:
        phase = "decode"
    return RunningTurn(
        agent_id=req.msg.agent_id,
        request_id=request_id,
        phase=phase,
        tokens_reused=started.tokens_reused if started is not None else 0,
        tokens_prefilled=req.prefilled,
        tokens_to_prefill=started.tokens_prefilled if started is not None else 0,
        tokens_generated=req.generated,
        max_tokens=req.msg.sampling.max_tokens,
        elapsed_ms=(time.perf_counter() - req.msg.submitted_at) * 1000.0,
    )
