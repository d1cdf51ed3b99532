"""Steps taken from a served engine while a workload runs: none ages out of the engine's bounded record."""

from __future__ import annotations

import asyncio
import threading

from boundless.engine.attention_time import AttentionTimeRecorder, ChunkShape
from boundless.sim.served_grid import taking_steps


def test_steps_are_taken_as_the_work_runs_so_none_ages_out_of_a_bounded_record() -> None:
    recorder = AttentionTimeRecorder(capacity=4)
    lock = threading.Lock()  # the engine loop's lock, which a take holds as the served engines' do

    def take() -> list:
        with lock:
            return recorder.drain()

    async def work() -> str:
        for i in range(30):  # far more steps than the record holds
            with lock:
                recorder.record([ChunkShape(i, 1)], 0.001 * (i + 1))
            if i % 3 == 2:
                await asyncio.sleep(0.02)
        return "done"

    result, steps = asyncio.run(taking_steps(work(), take, every_s=0.005))
    assert result == "done"
    assert [s.shapes[0].cached for s in steps] == list(range(30))
    assert len(recorder.drain()) == 0  # the last ones were taken after the work ended
