"""keras_dist._runtime.iterator_release: an iterator is destroyed on a deleting thread, only once no one else holds it."""

import threading
import time
import weakref

import pytest

from keras_dist._runtime import iterator_release


class _Iterator:
    def __next__(self):
        raise StopIteration


class _Dataset:
    element_spec = "spec"

    def __init__(self):
        self.made = []

    def __iter__(self):
        iterator = _Iterator()
        self.made.append(weakref.ref(iterator))
        return iterator


@pytest.fixture(autouse=True)
def own_releaser(monkeypatch):
    """A releaser of each test's own: the process's may be busy (its 4 deleting threads each destroying an earlier
    `fit`'s iterator over a generator, up to minutes each) or hold earlier tests' iterators (a full run failed so)."""
    releaser = iterator_release._Releaser()
    monkeypatch.setattr(iterator_release, "_RELEASER", releaser)
    yield releaser
    releaser.stop()


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _finalized_on(obj):
    threads = []
    weakref.finalize(obj, lambda: threads.append(threading.current_thread().name))
    return threads


@pytest.mark.timeout(30)
def test_an_iterator_still_referred_to_is_kept_and_destroyed_on_a_deleting_thread_once_let_go():
    iterator = _Iterator()
    threads = _finalized_on(iterator)
    iterator_release.hold(iterator)
    time.sleep(20 * iterator_release.POLL_S)
    assert threads == []  # Still ours here: not let go.
    del iterator
    assert _wait_for(lambda: threads)
    assert threads[0].startswith(iterator_release.THREAD_NAME + "_")


@pytest.mark.timeout(30)
def test_a_holding_dataset_hands_out_its_own_iterators_and_keeps_the_rest():
    dataset = _Dataset()
    wrapped = iterator_release.hold_iterators_of(dataset)
    assert wrapped is dataset and isinstance(wrapped, _Dataset)
    first, second = iter(wrapped), iter(wrapped)
    assert [ref() for ref in dataset.made] == [first, second]
    assert wrapped.element_spec == "spec"
    threads = _finalized_on(first)
    del first
    assert _wait_for(lambda: threads) and threads[0].startswith(iterator_release.THREAD_NAME + "_")
    assert dataset.made[1]() is second  # The other one is still the caller's.
    del second
    assert _wait_for(lambda: dataset.made[1]() is None)
    assert _wait_for(lambda: iterator_release.held() == 0)


def _release_in_child(queue):
    iterator = _Iterator()
    threads = _finalized_on(iterator)
    iterator_release.hold(iterator)
    del iterator
    queue.put(threads[0] if _wait_for(lambda: threads) else "not released")


@pytest.mark.timeout(60)
def test_a_forked_child_releases_its_own_iterators_on_a_thread_of_its_own():
    import multiprocessing

    parent_held = _Iterator()
    parent_threads = _finalized_on(parent_held)
    iterator_release.hold(parent_held)  # The parent's thread runs now, and holds one at the fork.
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_release_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=30).startswith(iterator_release.THREAD_NAME + "_")
    finally:
        child.join(30)
    assert child.exitcode == 0
    del parent_held
    assert _wait_for(lambda: parent_threads) and parent_threads[0].startswith(iterator_release.THREAD_NAME + "_")
    assert _wait_for(lambda: iterator_release.held() == 0)
