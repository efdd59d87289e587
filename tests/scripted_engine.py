"""The real MLX engine with replies forced, for tool-call tests on random-weight models.

A tiny random-weight model cannot write a tool call by itself. :class:`ScriptedEngine`
runs the real model (prefill, decode, caches, parking all as in production) and only
overrides sampling: the next turn's reply is forced, token by token, to a scripted text
followed by end-of-sequence (``SequenceSampling.forced``, the mechanism ``tool_choice``
uses for a call's opening). Without a script a turn samples as usual.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace

from runtime.plan.sampling import SamplingOptions
from runtime.execution.mlx_engine import MlxEngine
from runtime.execution.sequence import SequenceSampling
from runtime.reply.tool_calls import ReplyRules

__all__ = ["ScriptedEngine"]


class ScriptedEngine(MlxEngine):
    """``MlxEngine`` whose next turns reply with the texts given to :meth:`script`.

    ``boost``: token ids whose logits get +50 in every turn (a model that "wants" to
    write them; the turn's own logit bias, e.g. a ``tool_choice`` ban, wins).
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._replies: deque[str] = deque()
        self._lock = threading.Lock()
        self.boost: tuple[int, ...] = ()

    def script(self, *replies: str) -> None:
        """Force the next turns' replies (one text per turn, in order)."""
        with self._lock:
            self._replies.extend(replies)

    def reset(self) -> None:
        """Drop unused scripts and the boost."""
        with self._lock:
            self._replies.clear()
        self.boost = ()

    def sampling_params(self, sampling: SamplingOptions, rules: ReplyRules | None = None) -> SequenceSampling:
        params = super().sampling_params(sampling, rules)
        if self.boost:
            params = replace(params, logit_bias={**dict.fromkeys(self.boost, 50.0), **params.logit_bias})
        with self._lock:
            reply = self._replies.popleft() if self._replies else None
        if reply is None:
            return params
        eos = min(self.lm.eos_token_ids)
        return replace(params, forced=(*self.lm.tokenize(reply)[0], eos))
