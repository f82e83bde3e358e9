"""The stall watchdog on real worker processes (issue 21): who is named, and that nothing hangs.

Each test runs `stall_worker.py` on two loopback workers with `KERAS_DIST_STALL_TIMEOUT=8`
(warning at 4 s, error at 8 s). `run_workers` stops every worker when one fails (SIGTERM,
then SIGKILL: a stopped process included) and each test has a timeout.
"""

import os

import pytest

from keras_dist.testing import clean_env, run_workers

pytestmark = pytest.mark.multi_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "stall_worker.py")
ENV = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1", KERAS_DIST_STALL_TIMEOUT="8")
ERROR = "keras_dist.errors.WorkerStalledError: keras-dist stall watchdog: "


def _run(scenario, *, stop_on_failure=False, timeout=100, env=ENV):
    result = run_workers(WORKER, [scenario, "1"], env=env, timeout=timeout, stop_on_failure=stop_on_failure)
    assert not result.timed_out, "a worker hung: " + result[0].output[-3000:] + result[1].output[-3000:]
    return result


def _error_line(output):
    lines = [line for line in output.splitlines() if line.startswith(ERROR)]
    assert lines, output[-4000:]
    return lines[-1]


@pytest.mark.timeout(150)
def test_a_sleeping_callback_on_one_worker_fails_both_naming_it():
    result = _run("sleep")
    assert result.returncodes == {0: 1, 1: 1}, result[0].output[-3000:] + result[1].output[-3000:]
    waiting, stuck = _error_line(result[0].output), _error_line(result[1].output)
    assert waiting == stuck  # The same error on every worker.
    assert "worker:1 has been in Sleepy.on_train_batch_end (a callback) for " in waiting
    assert "last finished train step 6 (epoch 0)" in waiting
    assert "worker:0 waits for it in the workers' agreement all-reduce" in waiting
    assert "KERAS_DIST_STALL_TIMEOUT=8 s" in waiting
    # The warning comes first, at half the bound, on both sides.
    assert "WARNING: keras-dist stall watchdog: worker:1 has been in Sleepy" in result[0].output
    assert "WARNING: keras-dist stall watchdog: worker:1 (this worker) has been in Sleepy" in result[1].output
    # The stuck worker got it in its own main thread, out of the sleeping callback (not by being killed).
    assert "in on_train_batch_end\n    time.sleep(600)" in result[1].output


@pytest.mark.timeout(150)
def test_a_frozen_worker_is_named_by_the_others():
    result = _run("sigstop", stop_on_failure=True)  # The stopped worker ends only by SIGKILL.
    assert result.returncodes[0] == 1 and result.returncodes[1] == -9, result[0].output[-3000:]
    message = _error_line(result[0].output)
    assert "worker:1 is frozen: its process has not answered for " in message
    assert "worker:0 waits for it in " in message


@pytest.mark.timeout(150)
def test_a_chief_only_evaluate_is_named():
    result = _run("evaluate")
    assert result.returncodes == {0: 1, 1: 1}, result[0].output[-3000:] + result[1].output[-3000:]
    message = _error_line(result[0].output)
    assert message == _error_line(result[1].output)
    assert "worker:1 has been in the script, outside fit/evaluate/predict for " in message
    assert "worker:0 waits for it in evaluate" in message


@pytest.mark.timeout(150)
def test_a_slow_but_progressing_worker_is_not_flagged():
    # Worker 1 sleeps 1.5 s after every batch: the other waits for it in every step, never 10 s (half the
    # bound). A wider bound than the other tests': CI's 2 cores also run other tests, and Keras' loop
    # between steps (a new epoch's iterator) then takes seconds.
    result = _run("slow", timeout=130, env={**ENV, "KERAS_DIST_STALL_TIMEOUT": "20"})
    assert result.returncodes == {0: 0, 1: 0}, result[0].output[-3000:] + result[1].output[-3000:]
    for worker in result.workers:
        assert "FINISHED" in worker.output
        assert "stall watchdog" not in worker.output, worker.output[-3000:]
