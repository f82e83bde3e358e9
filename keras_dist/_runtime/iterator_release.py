"""Distributed iterators destroyed on threads of their own, never on the thread that runs the steps.

Under `MultiWorkerMirroredStrategy`, destroying a distributed iterator holds the
thread that drops it for 0.2 s, often about 1.25 s and sometimes far longer, while
the other workers wait in their next collective; under `MirroredStrategy` the step
thread itself waits, also where Python's cycle collector destroys a finished call's
iterator in the middle of a later step (60-120 s for an input over a Python
generator on TensorFlow 2.20-2.21) (compat fix
`blocking_iterator_deletion`, `benchmarks/epoch_stall.py`). The wait is tf.data's:
each iterator's pipelines (the host pipeline and each device's) run an autotuning
thread (`Model::OptimizeLoop`) that sleeps for an optimization period, doubling
from 10 ms to 60 s over the iterator's life, and the iterator's destructor
(`RootDataset::Iterator`) waits for that thread to wake (seen with gdb on TF 2.21:
the 1.25 s is 10 ms x 2**7). Keras drops one or two iterators every epoch of a
finite input and one at the end of each `evaluate`.

So each iterator a wrapped distributed dataset hands out is also held here; a
daemon thread polls the held iterators' reference counts and, once only this
module still refers to one, hands it to one of a few deleting threads, where
its destruction runs: no step waits for it, and deletions wait side by side.
Python finishes the deletions under way at exit (a thread stopped inside a
deletion aborts the process), which is where the last iterators' waits now
fall instead of at the end of `fit`.

What happens on each worker: each worker releases its own iterators; nothing is
exchanged between workers.
"""

import atexit
import concurrent.futures
import ctypes
import sys
import threading

POLL_S = 0.05  # How often the held iterators' reference counts are read.
THREAD_NAME = "keras-dist-iterator-release"  # The prefix of the names of the threads that destroy iterators.
DELETING_THREADS = 4
POLL_THREAD_NAME = "keras-dist-iterator-release-poll"  # The one that reads reference counts.

# References to a held iterator that are this module's own while `_Releaser._let_go` reads its count:
# the list entry, the loop variable and `sys.getrefcount`'s argument.
_OWN_REFERENCES = 3


class _Releaser:
    """Holds iterators and has each destroyed on a deleting thread once nothing else refers to it."""

    def __init__(self):
        self._condition = threading.Condition()
        self._held = []
        self._thread = None
        self._stopped = False
        self._deleting = None

    def hold(self, iterator):
        """Keeps `iterator` until only this releaser refers to it, then has it destroyed on a deleting thread."""
        with self._condition:
            if self._stopped:
                return  # Interpreter exit: the caller's references decide, as without the releaser.
            self._held.append(iterator)
            if self._thread is None or not self._thread.is_alive():  # Not started, or a forked child's.
                # Deletions run here, several at a time: each can wait up to a minute, and they must not
                # queue behind one another. Python finishes those under way at exit (a thread stopped
                # inside a deletion aborts the process); a thread per deletion aborted it too (TF 2.21).
                self._deleting = concurrent.futures.ThreadPoolExecutor(DELETING_THREADS, thread_name_prefix=THREAD_NAME)
                self._thread = threading.Thread(target=self._run, name=POLL_THREAD_NAME, daemon=True)
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
                boxes = [[iterator] for iterator in self._let_go()]  # Each box holds the last reference.
            for box in boxes:
                try:
                    self._deleting.submit(box.clear)
                except RuntimeError:  # Interpreter exit began: never destroyed, as in `stop`.
                    ctypes.pythonapi.Py_IncRef(ctypes.py_object(box.pop()))
            boxes = box = None
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
        """At interpreter exit, before Python joins the deleting threads: stops polling; never destroys the rest.

        A deletion can wait up to a minute (see the module docstring), so the
        process exits without the iterators still held: their memory goes
        with the process.
        """
        with self._condition:
            self._stopped = True
            held, self._held = self._held, []
            thread = self._thread
            self._condition.notify_all()
        for iterator in held:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(iterator))  # Never freed: no deletion at exit.
        if thread is not None and thread is not threading.current_thread():
            thread.join(POLL_S * 20)


_RELEASER = _Releaser()
# Before Python joins its threads at exit (not `atexit`, which runs after): from then on no deleting
# thread starts, and those under way are joined. `threading._register_atexit` is private (Python 3.9+,
# what concurrent.futures uses); where it is missing, `atexit` still stops new deletions at exit.
getattr(threading, "_register_atexit", atexit.register)(_RELEASER.stop)


def hold(iterator):
    """Has `iterator` destroyed on one of keras-dist's deleting threads once no one else refers to it.

    Args:
        iterator: Any object (a `tf.distribute.DistributedIterator` in practice).
    """
    _RELEASER.hold(iterator)


def held():
    """Returns the number of iterators waiting to be released."""
    return _RELEASER.held()


_HOLDING_CLASSES: dict[type, type] = {}


def hold_iterators_of(distributed):
    """Has every iterator `distributed` makes destroyed on keras-dist's deleting threads; returns `distributed`.

    Iterating it still gives its own iterators (what Keras passes to its step
    function), each also held here (`hold`). Its class becomes a subclass of
    its class whose `__iter__` does that, rather than a wrapper: Keras accepts
    a `distribute_datasets_from_function` dataset only with its TensorFlow
    class, and every other attribute stays the dataset's own.

    Args:
        distributed: A `tf.distribute` distributed dataset.

    Returns:
        `distributed` itself.
    """
    cls = type(distributed)
    if cls in _HOLDING_CLASSES.values():
        return distributed
    holding = _HOLDING_CLASSES.get(cls)
    if holding is None:

        def __iter__(self):
            iterator = cls.__iter__(self)
            hold(iterator)
            return iterator

        holding = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__})
        _HOLDING_CLASSES[cls] = holding
    distributed.__class__ = holding
    return distributed
