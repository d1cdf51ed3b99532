"""Steps taken from a served engine while a workload runs: none ages out of the engine's bounded record."""

from __future__ import annotations

import asyncio
import threading

from boundless.engine.attention_time import AttentionTimeRecorder, ChunkShape
from boundless.sim.served_grid import taking_steps


def test_steps_are_taken_as_the_work_runs_so_none_ages_out_of_a_bounded_record() -> None:
    recorder = AttentionTimeRecorder(capacity=4)
    lock = threading.Lock()  # the engine loop's lock, which a take holds as the served engines' do
    taken = [0]

    def take() -> list:
        with lock:
            steps = recorder.drain()
        taken[0] += len(steps)
        return steps

    async def work() -> str:
        for i in range(30):  # far more steps than the record holds
            with lock:
                recorder.record([ChunkShape(i, 1)], 0.001 * (i + 1))
            if i % 3 == 2:
                # Wait for a take (up to 5 s, not a fixed sleep: a loaded machine may run the taker's thread late).
                # Without takes while the work runs, 30 steps would go through a record of 4 and most age out.
                for _ in range(500):
                    if taken[0] == i + 1:
                        break
                    await asyncio.sleep(0.01)
        return "done"

    result, steps = asyncio.run(taking_steps(work(), take, every_s=0.005))
    assert result == "done"
    assert [s.shapes[0].cached for s in steps] == list(range(30))
    assert len(recorder.drain()) == 0  # the last ones were taken after the work ended
