"""Engine runs of later modules started while earlier ones run, so that CI's two cores stay busy.

Most session fixtures of ``tests/adapters/vllm`` are chains of engine runs,
one after the other (a load needs what a save stored). Such a chain keeps one
core busy: most of an engine's start is Python importing vLLM on one thread.
:func:`prefetched` makes a fixture's chain a *job* that two background lanes
run ahead of the tests, in the order the tests will ask for them, while the
tests of the modules before it run; a test that asks for a job's result
before a lane got to it runs the job itself.

:data:`ENGINE_SLOTS` bounds the engine runs at any moment, whoever starts
them (a lane, a test, ``servers.side_by_side``), by weight:
:func:`engine_slot` around every engine process. That is what
``side_by_side`` ran before (on 2 cores two TP = 1 engines, or a TP = 2 one
beside a TP = 1 one, never two multi-rank ones), with fewer idle cores
between them. While a fleet of servers serves (its engines keep the cores busy) the
lanes take up no further job. Each engine computes alone in its
process, so every token and byte is what a run alone gives; only the wall
time of the whole suite changes.

Example:
    >>> import pytest
    >>> @pytest.fixture(scope="session")
    ... @prefetched
    ... def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    ...     return {}
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

__all__ = ["ENGINE_SLOTS", "engine_slot", "fleet_down", "fleet_up", "prefetched", "start"]

T = TypeVar("T")
CORES = max(1, os.cpu_count() or 1)
LANES = 2

_lock = threading.Lock()
#: Registered jobs by fixture function (what pytest resolves a fixture name to): its build function.
_JOBS: dict[Callable[..., Any], Callable[[pytest.TempPathFactory], Any]] = {}
#: A job's outcome once someone (a lane or a test) took it up.
_FUTURES: dict[Callable[..., Any], Future[Any]] = {}
_started = False


#: How long an engine waits for a slot: far longer than any engine runs, so that a slot never given back (a bug
#: in a test) fails the test instead of hanging the suite.
SLOT_WAIT_S = 1800.0
#: What an engine of one process and one of several ranks weigh against :data:`ENGINE_SLOTS`' capacity
#: (``2 * CORES + 1``): one-process engines up to one per core, a multi-rank engine beside one-process engines
#: up to one less, never two multi-rank engines together (their ranks are bound to the same cores and wait for
#: each other in every all-reduce). On 2 cores: two TP = 1 engines, or a TP = 2 one beside a TP = 1 one.
ONE_PROCESS, MULTI_RANK = 2, 3


class _Slots:
    """A semaphore of weighted takers (:data:`ONE_PROCESS`, :data:`MULTI_RANK`)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = self.free = capacity
        self._cond = threading.Condition()

    def acquire(self, weight: int, timeout: float) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self.free >= weight, timeout):
                return False
            self.free -= weight
            return True

    def release(self, weight: int) -> None:
        with self._cond:
            self.free += weight
            self._cond.notify_all()


#: Engines at once, over the whole session, whoever starts them.
ENGINE_SLOTS = _Slots(max(2 * CORES + 1, MULTI_RANK))


@contextmanager
def engine_slot(ranks: int = 1) -> Iterator[None]:
    """Hold a share of :data:`ENGINE_SLOTS` while an engine of ``ranks`` processes runs (waiting for it to be free)."""
    weight = MULTI_RANK if ranks > 1 else ONE_PROCESS
    if not ENGINE_SLOTS.acquire(weight, SLOT_WAIT_S):
        pytest.fail(f"no engine slot came free in {SLOT_WAIT_S:.0f} s")
    try:
        yield
    finally:
        ENGINE_SLOTS.release(weight)


_fleets = 0
_no_fleet = threading.Condition(_lock)


def fleet_up() -> None:
    """A fleet of servers started: the lanes take up no further job until it stops.

    A fleet's engines keep the cores busy while it serves. A job a lane runs
    already goes on (a test of the fleet's module may be waiting for it), and
    engines started on the tests' own thread never wait for a fleet: that
    thread may hold one while it runs them.
    """
    global _fleets
    with _lock:
        _fleets += 1


def fleet_down() -> None:
    """A fleet of servers stopped: with none left, the lanes go on."""
    global _fleets
    with _lock:
        _fleets = max(0, _fleets - 1)
        if not _fleets:
            _no_fleet.notify_all()


def prefetched(build: Callable[[pytest.TempPathFactory], T]) -> Callable[[pytest.TempPathFactory], T]:
    """Make ``build(tmp_path_factory)`` a job the lanes may run early; decorate it under ``@pytest.fixture``.

    ``build`` takes the session's ``tmp_path_factory`` and nothing else, and
    returns plain results (paths, outputs): it runs on another thread, so it
    must not touch pytest's per-test state. Failures and skips (``pytest.fail``
    in ``require``) reach the test that asks for the result, as they would have.
    """

    @functools.wraps(build)
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> T:
        future, mine = _claim(fixture)
        if mine:
            _run(build, tmp_path_factory, future)
        result: T = future.result()
        return result

    _JOBS[fixture] = build
    return fixture


def _claim(fixture: Callable[..., Any]) -> tuple[Future[Any], bool]:
    """The job's future, and whether the caller took the job up (and must run it)."""
    with _lock:
        if fixture in _FUTURES:
            return _FUTURES[fixture], False
        future: Future[Any] = Future()
        _FUTURES[fixture] = future
        return future, True


def _run(build: Callable[[pytest.TempPathFactory], Any], tmp: pytest.TempPathFactory, future: Future[Any]) -> None:
    try:
        future.set_result(build(tmp))
    except BaseException as exc:  # pytest.fail and pytest.skip raise BaseExceptions: the asking test re-raises them
        future.set_exception(exc)


def start(items: Sequence[pytest.Item], tmp: pytest.TempPathFactory) -> None:
    """Start the lanes on the jobs ``items`` ask for, in the order they ask (once per session)."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    order: list[Callable[..., Any]] = []
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # pytest's resolution of the item's fixture names
        for defs in getattr(info, "name2fixturedefs", {}).values():
            for fixturedef in defs:
                func = getattr(fixturedef, "func", None)
                if func in _JOBS and func not in order:
                    order.append(func)
    if not order:
        return
    queue = iter(order)

    def lane() -> None:
        while True:
            with _lock:
                _no_fleet.wait_for(lambda: not _fleets)
                fixture = next(queue, None)
            if fixture is None:
                return
            future, mine = _claim(fixture)
            if mine:
                _run(_JOBS[fixture], tmp, future)

    for n in range(min(LANES, len(order))):
        # Daemons: an interrupted session does not wait for them (their engines end with their timeouts).
        threading.Thread(target=lane, name=f"prefetch-lane-{n}", daemon=True).start()
