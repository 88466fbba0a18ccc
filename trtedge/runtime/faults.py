"""Test-only fault injection, read from ``$TRTEDGE_TEST_FAULT`` when an engine is built.

``step=N`` makes the N-th model step raise once, ``step=always`` makes every step raise,
``token=ID`` makes every step raise that computes a sequence whose prompt holds token ID (a
"poison" request), ``restart=fail`` makes every engine restart fail, ``slow_call=S`` makes an
engine core process answer each call S seconds late, and ``step_delay=S`` makes every model step
start S seconds late (a slow model) (e.g. ``TRTEDGE_TEST_FAULT=token=7777,restart=fail``).
Unset (the normal case) it does nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from trtedge.runtime.core.request import Sequence

ENV = "TRTEDGE_TEST_FAULT"


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


@dataclass
class FaultInjector:
    step: int | None = None  # the model step that raises once (1-based)
    every_step: bool = False
    poison_token: int | None = None
    fail_restart: bool = False
    slow_call: float = 0.0  # seconds an engine core process waits before answering a call
    step_delay: float = 0.0  # seconds every model step waits before it runs
    num_steps: int = 0

    @classmethod
    def from_env(cls) -> FaultInjector:
        spec = os.environ.get(ENV, "").strip()
        faults = cls()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = item.partition("=")
            if key == "step" and value == "always":
                faults.every_step = True
            elif key == "step" and value.isdigit() and int(value) > 0:
                faults.step = int(value)
            elif key == "token" and value.isdigit():
                faults.poison_token = int(value)
            elif key == "restart" and value == "fail":
                faults.fail_restart = True
            elif key in ("slow_call", "step_delay") and value.replace(".", "", 1).isdigit():
                setattr(faults, key, float(value))
            else:
                raise ValueError(
                    f"${ENV}: unknown fault {item!r} (step=N, step=always, token=ID, restart=fail, slow_call=S, step_delay=S)"
                )
        return faults

    def before_model_step(self, seqs: list[Sequence]) -> None:
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.every_step or self.num_steps == self.step:
            raise InjectedFault(f"injected fault in model step {self.num_steps}")
        poison = self.poison_token
        if poison is not None and any(poison in s.token_ids[: s.num_prompt_tokens] for s in seqs):
            raise InjectedFault(f"injected fault: a prompt holds token {poison}")

    def before_restart(self) -> None:
        if self.fail_restart:
            raise InjectedFault("injected fault: the engine cannot restart")
