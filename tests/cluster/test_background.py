"""The shared background runner: one task per start, a clean stop, and a poll loop that outlives a
failed round."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tokenops.cluster.background import BackgroundTask, poll_every


def test_start_twice_runs_once_and_stop_waits_for_the_end() -> None:
    async def main() -> tuple[int, bool, bool]:
        started, ended = 0, asyncio.Event()

        async def run() -> None:
            nonlocal started
            started += 1
            try:
                await asyncio.sleep(3600)
            finally:
                ended.set()

        task = BackgroundTask(run, "probe")
        task.start()
        task.start()
        await asyncio.sleep(0)
        was_running = task.running
        await task.stop()
        await task.stop()  # a second stop is a no-op
        return started, was_running and ended.is_set(), task.running

    assert asyncio.run(main()) == (1, True, False)


def test_poll_every_logs_a_failed_round_and_keeps_polling(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> int:
        rounds = 0
        third = asyncio.Event()

        async def round_(client: object) -> None:
            nonlocal rounds
            rounds += 1
            if rounds == 3:
                third.set()
            if rounds == 1:
                raise RuntimeError("boom")

        log = logging.getLogger("probe")
        task = BackgroundTask(lambda: poll_every(0.001, round_, log, "probe poll"), "p")
        task.start()
        await asyncio.wait_for(third.wait(), 10)
        await task.stop()
        return rounds

    with caplog.at_level(logging.ERROR, logger="probe"):
        assert asyncio.run(main()) >= 3
    assert [r.getMessage() for r in caplog.records] == ["probe poll round failed"]
