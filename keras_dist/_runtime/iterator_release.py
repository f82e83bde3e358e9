"""Distributed iterators destroyed on a thread of their own, never on the thread that runs the steps.

Under `MultiWorkerMirroredStrategy`, destroying a distributed iterator (its
multi-device buffers and the tf.data pipeline behind them) holds the thread that
drops it for 0.2 s, often about 1.25 s and sometimes far longer, while the other
workers wait in their next collective (compat fix `iterator_deletion_off_the_step`,
`benchmarks/epoch_stall.py`). Keras drops one or two iterators every epoch of a
finite input and one at the end of each `evaluate`. The same deletion done on
another thread holds up no step.

So each iterator a wrapped distributed dataset hands out is also held here; a
daemon thread polls the held iterators' reference counts and, once only this
module still refers to one, lets it go: its destruction then runs on that thread.

What happens on each worker: each worker releases its own iterators; nothing is
exchanged between workers.
"""

import atexit
import sys
import threading

POLL_S = 0.05  # How often the held iterators' reference counts are read.
EXIT_JOIN_S = 10.0  # How long interpreter exit waits for a deletion under way.
THREAD_NAME = "keras-dist-iterator-release"

# References to a held iterator that are this module's own while `_Releaser._let_go` reads its count:
# the list entry, the loop variable and `sys.getrefcount`'s argument.
_OWN_REFERENCES = 3


class _Releaser:
    """Holds iterators and drops each on its own daemon thread once nothing else refers to it."""

    def __init__(self):
        self._condition = threading.Condition()
        self._held = []
        self._thread = None
        self._stopped = False

    def hold(self, iterator):
        """Keeps `iterator` until only this releaser refers to it, then drops it on the release thread."""
        with self._condition:
            if self._stopped:
                return  # Interpreter exit: the caller's references decide, as without the releaser.
            self._held.append(iterator)
            if self._thread is None or not self._thread.is_alive():  # Not started, or a forked child's.
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()
            self._condition.notify()

    def held(self):
        """Returns how many iterators are held (for tests)."""
        with self._condition:
            return len(self._held)

    def _run(self):
        while True:
            with self._condition:
                while not self._held and not self._stopped:
                    self._condition.wait()
                if self._stopped:
                    return
                released = self._let_go()
            released.clear()  # The last reference: destruction runs here, outside the lock.
            self._condition_wait(POLL_S)

    def _let_go(self):
        """Returns (and stops holding) the held iterators nothing else refers to. Called with the lock held."""
        released, kept = [], []
        for iterator in self._held:
            (released if sys.getrefcount(iterator) <= _OWN_REFERENCES else kept).append(iterator)
        iterator = None
        self._held = kept
        return released

    def _condition_wait(self, seconds):
        with self._condition:
            if not self._stopped:
                self._condition.wait(seconds)

    def stop(self):
        """At interpreter exit: stops the thread after the deletion under way, and lets the rest go here."""
        with self._condition:
            self._stopped = True
            held, self._held = self._held, []
            thread = self._thread
            self._condition.notify_all()
        del held  # Whatever the caller still holds is destroyed when the caller lets it go, as without the releaser.
        if thread is not None and thread is not threading.current_thread():
            thread.join(EXIT_JOIN_S)


_RELEASER = _Releaser()
atexit.register(_RELEASER.stop)


def hold(iterator):
    """Has `iterator` destroyed on the release thread once no one else refers to it.

    Args:
        iterator: Any object (a `tf.distribute.DistributedIterator` in practice).
    """
    _RELEASER.hold(iterator)


def held():
    """Returns the number of iterators waiting to be released."""
    return _RELEASER.held()


class ReleasedOffTheStep:
    """A distributed dataset whose iterators are destroyed on the release thread.

    Iterating it gives the wrapped dataset's own iterators (what Keras passes
    to its step function); every other attribute is the wrapped dataset's.

    Args:
        distributed: A `tf.distribute.DistributedDataset` (or a wrapper of one).
    """

    def __init__(self, distributed):
        self._distributed = distributed

    def __iter__(self):
        iterator = iter(self._distributed)
        hold(iterator)
        return iterator

    def __getattr__(self, name):
        return getattr(self._distributed, name)
