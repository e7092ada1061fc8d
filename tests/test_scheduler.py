"""Admission across clients: a free slot goes to the client served the fewest tokens (its counter: prompt tokens
computed, weighted 1, and tokens generated, weighted 2), then with the fewest requests running (first queued
among equals), each client's requests in their order, one client's alone first come, first served; a client
arriving starts from the least counter of those holding requests; and a named client's bound on the requests it
holds. Turns are run by hand (Engine.pump) and the order of admission read from the Admitted events, so nothing
here depends on timing. A request named "a1" has the prompt [1, ord("a"), ord("1")]: 3 tokens."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from llama_core import Llama, ServerBusyError
from llama_core.serving import Admitted, Channel, Engine

from conftest import engine_model_dir

SLOTS, MAX_WAITING = 3, 4  # a named client holds at most 3 + 4 // 2 = 5 requests


@pytest.fixture(scope="module")
def loaded():
    return Llama.build(engine_model_dir(), max_seq_len=128, max_batch_size=SLOTS, seed=0).loaded


@pytest.fixture
def engine(loaded):
    engine = Engine(loaded, seed=0, max_waiting=MAX_WAITING)
    yield engine
    engine.close()


class _Recorder:
    """A request's events: its name goes to the shared log as it is admitted."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def put(self, item: Any) -> None:
        if isinstance(item, Admitted):
            self.log.append(self.name)
            self.cached_tokens = item.cached_tokens


def _add(engine: Engine, log: list[str], name: str, client: Optional[str], max_new_tokens: int,
         prompt: Optional[list[int]] = None) -> Channel:
    """Queues a greedy request that writes exactly max_new_tokens tokens (EOS banned), named in the log."""
    request = engine.check(prompt or [1] + [ord(c) for c in name], max_new_tokens, temperature=0, client=client,
                           logit_bias={engine.eos_id: -100})
    channel = Channel(events=_Recorder(name, log))
    engine.add(request, channel)
    return channel


def _run(engine: Engine, channels: list[Channel]) -> None:
    for _ in range(1000):
        if all(c.finished.is_set() for c in channels):
            return
        engine.pump()
    raise AssertionError("the requests did not end")


def test_a_freed_slot_goes_to_another_client_before_the_queued_requests_of_the_one_filling_the_slots(engine):
    """The load test's case: one client's long requests fill every slot and wait behind them; another
    client's request, queued last, is admitted at the first free slot (first come, first served put it
    behind all of them)."""
    log: list[str] = []
    channels = [_add(engine, log, "a1", "A", 2)] + [_add(engine, log, name, "A", 40) for name in ("a2", "a3")]
    engine.pump()  # they run; a1 ends first
    channels += [_add(engine, log, name, "A", 40) for name in ("a4", "a5")] + [_add(engine, log, "b1", "B", 2)]
    _run(engine, channels)
    assert log == ["a1", "a2", "a3", "b1", "a4", "a5"]


def test_the_client_with_fewer_requests_running_goes_first_and_equals_go_in_queue_order(engine):
    log: list[str] = []
    channels = [_add(engine, log, "a1", "A", 40), _add(engine, log, "a2", "A", 40)]
    engine.pump()
    channels.append(_add(engine, log, "b1", "B", 2))
    engine.pump()
    channels += [_add(engine, log, "a3", "A", 2), _add(engine, log, "c1", "C", 2), _add(engine, log, "b2", "B", 2)]
    _run(engine, channels)
    # A runs two long ones and has had the most throughout. b1 ends: C came in at B's counter while b1 ran (and
    # was queued before b2); c1 ends: B has had less than C.
    assert log == ["a1", "a2", "b1", "c1", "b2", "a3"]


def test_requests_without_a_client_count_as_one_client(engine):
    log: list[str] = []
    channels = [_add(engine, log, "n1", None, 2), _add(engine, log, "n2", None, 40), _add(engine, log, "n3", None, 40)]
    engine.pump()
    channels += [_add(engine, log, "n4", None, 40), _add(engine, log, "b1", "B", 2)]
    _run(engine, channels)
    assert log == ["n1", "n2", "n3", "b1", "n4"]  # each its own client, n4 (none running) would tie b1 and go first


def test_one_clients_requests_are_admitted_first_come_first_served(engine):
    log: list[str] = []
    lengths = [5, 2, 30, 3, 2, 8, 4]
    channels = [_add(engine, log, f"r{i}", "A", n) for i, n in enumerate(lengths[:5])]
    _run(engine, channels[:1])  # the others come while these run
    channels += [_add(engine, log, f"r{i}", "A", n) for i, n in enumerate(lengths[5:], 5)]
    _run(engine, channels)
    assert log == [f"r{i}" for i in range(len(lengths))]


def test_a_named_client_holds_every_slot_and_half_the_queue_and_no_more(engine, loaded):
    assert engine.client_capacity == SLOTS + MAX_WAITING // 2 and engine.capacity == SLOTS + MAX_WAITING
    log: list[str] = []
    held = [_add(engine, log, f"a{i}", "A", 40) for i in range(engine.client_capacity)]
    engine.pump()  # three of them run, two wait
    assert engine.active_count == SLOTS and engine.waiting_count == 2
    with pytest.raises(ServerBusyError, match="server busy: this client already has 5 requests running and waiting"):
        _add(engine, log, "a5", "A", 40)
    others = [_add(engine, log, "b1", "B", 2), _add(engine, log, "c1", "C", 2)]  # the other half of the queue
    with pytest.raises(ServerBusyError, match="server busy: 3 requests running and 4 waiting"):
        _add(engine, log, "d1", "D", 2)
    held[0].cancelled.set()
    engine.pump()  # the cancelled request ends; b1 takes its slot
    assert log[-1] == "b1"
    held.append(_add(engine, log, "a5", "A", 40))  # A holds 4: one more is taken
    for channel in held:
        channel.cancelled.set()
    _run(engine, held + others)


def test_a_request_sharing_a_prefix_being_computed_waits_for_it_and_the_next_in_turn_goes_ahead(engine):
    log: list[str] = []
    shared = [1] + [10 + i for i in range(40)]  # longer than MIN_SHARED_PREFIX
    channels = [_add(engine, log, "a1", "A", 4, shared + [60])]
    channels += [_add(engine, log, "b1", "B", 4, shared + [61]), _add(engine, log, "c1", "C", 4)]
    engine.pump()  # b1's turn comes second (B runs none, A one), but a1 computes its prefix: c1 goes ahead
    assert log == ["a1", "c1"]
    _run(engine, channels)
    assert log == ["a1", "c1", "b1"] and channels[1].events.cached_tokens == len(shared)


def test_a_client_served_more_tokens_waits_behind_one_served_fewer_though_both_run_as_many(engine):
    log: list[str] = []
    channels = [_add(engine, log, "a1", "A", 40), _add(engine, log, "a2", "A", 20),
                _add(engine, log, "b1", "B", 40, [1] + [200 + i for i in range(9)])]
    engine.pump()
    channels += [_add(engine, log, "a3", "A", 2), _add(engine, log, "b2", "B", 2)]
    _run(engine, channels)
    # a2 ends: A and B run one each, but A has had twice B's tokens generated (2 * 20 in each of a1 and a2), while
    # B's longer prompt counted more (10 against 3 + 3)
    assert log == ["a1", "b1", "a2", "b2", "a3"]


def test_prompt_tokens_computed_count_and_those_found_in_the_prefix_cache_do_not(engine):
    log: list[str] = []
    shared = [1] + [10 + i for i in range(60)]
    _run(engine, [_add(engine, log, "z", None, 1, shared + [99])])  # its slot keeps the shared prefix
    log.clear()
    channels = [_add(engine, log, "a1", "A", 40, shared + [98]),  # 62 tokens, 61 of them cached: counts 1
                _add(engine, log, "b1", "B", 40, [1] + [200 + i for i in range(30)]),  # 31 tokens computed
                _add(engine, log, "c1", "C", 2)]
    engine.pump()
    channels += [_add(engine, log, "b2", "B", 2), _add(engine, log, "a2", "A", 2)]
    _run(engine, channels)
    assert channels[0].events.cached_tokens == len(shared)
    # c1 ends: A and B run one each, as many tokens generated; A's prompt cost 1, B's 31: a2 goes first
    assert log == ["a1", "b1", "c1", "a2", "b2"]


def test_an_arriving_client_starts_from_the_least_counter_and_fewer_running_breaks_the_tie(engine):
    """C arrives at B's counter: not behind B for all B was served before, nor ahead of B for all of it (from
    nothing, C would take every slot until it had had as much)."""
    log: list[str] = []
    channels = [_add(engine, log, "b1", "B", 30), _add(engine, log, "b2", "B", 30), _add(engine, log, "b3", "B", 40)]
    _run(engine, channels[:2])  # b3 runs on: two slots are free
    channels += [_add(engine, log, "b4", "B", 2)] + [_add(engine, log, f"c{i}", "C", 2) for i in (1, 2, 3)]
    _run(engine, channels)
    # Equal counters: C runs none, B one, so c1; then C's counter has its prompt, and b4 goes before c2.
    assert log == ["b1", "b2", "b3", "c1", "b4", "c2", "c3"]


def test_a_client_back_after_a_pause_keeps_what_it_was_served_above_the_others(engine):
    log: list[str] = []
    channels = [_add(engine, log, "a1", "A", 20), _add(engine, log, "a2", "A", 20), _add(engine, log, "x1", "X", 60)]
    _run(engine, channels[:2])  # A has nothing left, and had twice X's tokens
    channels += [_add(engine, log, "x2", "X", 60), _add(engine, log, "x3", "X", 60)]
    engine.pump()  # they take the freed slots
    channels += [_add(engine, log, "a3", "A", 2), _add(engine, log, "b1", "B", 2)]
    _run(engine, channels)
    # x1 ends: B arrived at X's counter, A came back with more (lifted to X's, it would go first as queued first)
    assert log == ["a1", "x1", "a2", "x2", "x3", "b1", "a3"]


def test_the_counters_of_clients_gone_are_forgotten_once_the_others_have_had_as_much(engine):
    log: list[str] = []
    running = [_add(engine, log, "x1", "X", 100), _add(engine, log, "x2", "X", 100)]
    engine.pump()
    for i in range(5):  # each has 3 + 2 * 10 while X has 2 * 2 * 10
        _run(engine, [_add(engine, log, f"c{i}", f"C{i}", 10)])
    assert set(engine._scheduler.served) <= {"X", "C4"}
    for channel in running:
        channel.cancelled.set()
    _run(engine, running)
