"""One engine instance in its own process: the body of a Ray actor.

The actor runs an :class:`~boundless.engine.async_engine.EngineLoop` and keeps its deltas in an
outbox that the router drains with long polls. Calls return plain values (errors as tuples), so
nothing depends on how Ray wraps exceptions.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from boundless.cluster.dispatcher import AddResult
from boundless.config import EngineConfig
from boundless.engine.async_engine import EngineLoop, QueueFullError
from boundless.engine.core import EngineCore, EngineStats, RequestDelta, Resume
from boundless.engine.errors import InvalidRequestError
from boundless.engine.sampling_params import SamplingParams
from boundless.model.loader import load_model
from boundless.programs.ref import ProgramRef

# Test hook: with this variable set in an instance's environment, ``add`` raises for a request whose
# seed equals its value, as a request that trips a bug in the engine would.
FAIL_ADD_SEED_ENV = "BOUNDLESS_TEST_FAIL_ADD_SEED"


@dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    pid: int
    node: str
    max_model_len: int
    device: str


class EngineInstance:
    """An engine, its loop thread and an outbox of deltas."""

    def __init__(self, instance_id: str, config: EngineConfig, max_waiting: int, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.instance_id = instance_id
        fail_seed = os.environ.get(FAIL_ADD_SEED_ENV)
        self._fail_add_seed = int(fail_seed) if fail_seed else None
        loaded = load_model(config.model.model, dtype=config.model.dtype, device=config.model.device)
        self.core = EngineCore.from_model(loaded, config)
        self._outbox: list[RequestDelta] = []
        self._ready = threading.Condition()
        self.loop = EngineLoop(self.core, self._sink, max_waiting)

    def _sink(self, delta: RequestDelta) -> None:
        delta.instance = self.instance_id
        with self._ready:
            self._outbox.append(delta)
            self._ready.notify_all()

    def info(self) -> InstanceInfo:
        return InstanceInfo(
            self.instance_id, os.getpid(), os.uname().nodename, self.core.max_model_len, self.core.identity.device
        )

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        program: ProgramRef | None = None,
        resume: Resume | None = None,
    ) -> AddResult:
        if self._fail_add_seed is not None and params.seed == self._fail_add_seed:
            raise RuntimeError(f"test hook {FAIL_ADD_SEED_ENV}: add fails for seed {params.seed}")
        try:
            self.loop.add(request_id, prompt_token_ids, params, program, resume)
        except InvalidRequestError as e:
            return AddResult("invalid", str(e), e.param)
        except QueueFullError as e:
            return AddResult("busy", str(e))
        return AddResult("ok")

    def drain(self, timeout_s: float = 0.1) -> list[RequestDelta]:
        """Deltas since the last drain; waits up to ``timeout_s`` for the first one."""
        with self._ready:
            if not self._outbox:
                self._ready.wait(timeout_s)
            out, self._outbox = self._outbox, []
        return out

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def heartbeat(self) -> EngineStats:
        return self.loop.stats()["0"]

    def shutdown(self) -> None:
        self.loop.shutdown()
