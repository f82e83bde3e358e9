"""`keras-dist launch`'s restart policy (`keras_dist.cli._elastic.Membership`): fixed and elastic."""

import pytest

from keras_dist.cli._elastic import Membership


def test_fixed_policy_restarts_everyone_up_to_max_restarts_in_all():
    m = Membership(num_workers=2, max_restarts=2)
    assert [m.after_failure(1).restart, m.after_failure(0).restart, m.after_failure(1).restart] == [True, True, False]
    assert m.slots == [0, 1] and m.attempt == 2


def test_min_workers_equal_to_the_count_is_the_fixed_policy():
    m = Membership(num_workers=2, max_restarts=1, min_workers=2)
    assert not m.elastic
    assert [m.after_failure(0).restart, m.after_failure(1).restart] == [True, False]


def test_elastic_budget_is_per_slot_and_the_rest_are_renumbered():
    m = Membership(num_workers=3, max_restarts=1, min_workers=1)
    assert m.after_failure(0).restart and m.after_failure(2).restart  # One restart each.
    assert m.slots == [0, 1, 2]
    decision = m.after_failure(0)  # Slot 0's second failure: dropped.
    assert decision.restart and m.slots == [1, 2]
    assert [m.worker_slot(0), m.worker_slot(1)] == [1, 2]
    assert "continuing with 2 workers instead of 3 (slots 1, 2 as workers 0-1; --min-workers 1)" in decision.message


def test_a_dropped_slot_rejoins_at_the_next_restart_for_one_try():
    m = Membership(num_workers=3, max_restarts=0, min_workers=1)
    m.after_failure(1)
    assert m.slots == [0, 2]
    decision = m.after_failure(m.worker_slot(1))  # Slot 2 fails: dropped; slot 1 is tried again.
    assert m.slots == [0, 1] and "Worker slot 1 rejoins (slots 0, 1 as workers 0-1)." in decision.message
    decision = m.after_failure(1)  # Its one try failed: dropped for good; slot 2 rejoins.
    assert decision.restart and m.slots == [0, 2]
    decision = m.after_failure(2)  # Slot 2's one try failed too: no one rejoins.
    assert decision.restart and m.slots == [0] and "rejoin" not in decision.message
    assert not m.after_failure(0).restart


def test_elastic_launch_always_ends():
    m = Membership(num_workers=4, max_restarts=2, min_workers=1)
    failures = 0
    while m.after_failure(m.slots[failures % len(m.slots)]).restart:
        failures += 1
        assert failures < 4 * (2 + 2)


def test_elastic_stops_when_fewer_than_min_workers_would_remain():
    m = Membership(num_workers=3, max_restarts=0, min_workers=2)
    assert m.after_failure(1).restart and m.slots == [0, 2]
    decision = m.after_failure(2)  # Slot 1 rejoins: still 2.
    assert decision.restart and m.slots == [0, 1]
    assert m.after_failure(1).restart and m.slots == [0, 2]  # Slot 1 is out for good; slot 2 rejoins.
    decision = m.after_failure(2)
    assert not decision.restart
    assert "1 worker would remain, fewer than --min-workers 2: stopping." in decision.message


@pytest.mark.parametrize("min_workers", [0, 4])
def test_min_workers_out_of_range(min_workers):
    with pytest.raises(ValueError, match=r"must be from 1 to the number of workers \(3\)"):
        Membership(num_workers=3, max_restarts=1, min_workers=min_workers)
