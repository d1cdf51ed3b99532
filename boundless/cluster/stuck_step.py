"""Whether an instance is stuck inside a step: the cluster's watchdog over its engines' forward passes.

An engine whose forward pass never returns still answers its ``drain`` and ``heartbeat`` (the pass runs outside the
engine loop's lock), so the heartbeat timeout never fires for it. Its heartbeat reports the step in flight
(``engine/step_watch.py``); a step that has run longer than ``--step-timeout-s`` makes the front end call the
instance lost (``Dispatcher.instance_lost``), as for a dead one: it is killed and its calls fail over with the
tokens they produced. An idle engine reports no step, so it is never lost however long it idles. SGLang's
``--watchdog-timeout`` (300 s) and vLLM's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s) watch the same thing, a
batch whose forward pass does not finish; they kill or fail the whole server, where a cluster fails over.
"""

from __future__ import annotations

from boundless.engine.step_watch import StepReport


def stuck_step(step: StepReport | None, limit_s: float) -> str | None:
    """Why an instance whose heartbeat reported ``step`` is lost, or None while it is not: its step in flight has
    run longer than ``limit_s``. ``running_s`` is measured by the instance's own clock when it answered, so the two
    machines' clocks need not agree."""
    if step is None or step.running_s <= limit_s:
        return None
    return f"step running {step.running_s:.0f} s (limit {limit_s:g} s; {step.describe()})"
