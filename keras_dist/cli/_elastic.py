"""Who `keras-dist launch` starts on each attempt, and whether a failed attempt is restarted.

Owns: the restart policy of `--max-restarts` and `--min-workers` (pure: no
processes, no TensorFlow), as `Membership`.
Must not: start or signal processes (`_worker_group.py` does), or import
TensorFlow or Keras.

Two policies, as torchrun's `--max-restarts` and `--nnodes=MIN:MAX`:
- Fixed (no `--min-workers`, or `--min-workers` equal to the worker count):
  the whole group is restarted after a failure, up to `max_restarts` times in
  all, always with every worker.
- Elastic (`--min-workers M` below the worker count): each worker slot (the
  task index it had at the first attempt) may fail `max_restarts` times, each
  followed by a restart of the group. A slot that fails once more is dropped,
  and the rest restart without it, renumbered 0..W'-1 in slot order, while at
  least M remain; else the launch ends with the failure. A dropped slot is
  tried again (one try) at the next restart that another slot's failure
  causes: it rejoins, or after its next failure is dropped for good. So the
  launch always ends: each slot fails at most `max_restarts` + 2 times.
The slot blamed for a failed attempt is the first worker seen exiting with a
nonzero status.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Decision:
    """What `Membership.after_failure` decided.

    Attributes:
        restart: Bool, whether to start another attempt.
        message: String, the launcher's line for stderr (without its prefix).
    """

    restart: bool
    message: str


class Membership:
    """The worker slots of each attempt of a local launch, and the restart policy.

    Args:
        num_workers: Integer >= 1, the workers of the first attempt (slots
            0..num_workers-1).
        max_restarts: Integer >= 0, `--max-restarts`.
        min_workers: Integer from 1 to `num_workers`, `--min-workers`, or
            `None` (the fixed policy).

    Raises:
        ValueError: `min_workers` is outside 1..`num_workers`.

    Example:
    >>> m = Membership(num_workers=3, max_restarts=1, min_workers=2)
    >>> m.slots
    [0, 1, 2]
    >>> m.after_failure(2).restart, m.slots
    (True, [0, 1, 2])
    >>> m.after_failure(2).message
    'worker slot 2 failed 2 times (its 1 restart is used up): continuing with 2 workers instead of 3 (slots 0, 1 as workers 0-1; --min-workers 2). A BackupAndRestore in fit resumes from its last backup.'
    >>> m.slots
    [0, 1]
    """

    def __init__(self, num_workers, max_restarts, min_workers=None):
        if min_workers is not None and not 1 <= min_workers <= num_workers:
            raise ValueError(
                f"`--min-workers` must be from 1 to the number of workers ({num_workers}). "
                f"Received: --min-workers={min_workers}. Fix: pass a count from 1 to {num_workers}, or drop it."
            )
        self.num_workers = num_workers
        self.max_restarts = max_restarts
        self.min_workers = min_workers
        self.elastic = min_workers is not None and min_workers < num_workers
        self.slots = list(range(num_workers))
        self.attempt = 0
        self._failures = dict.fromkeys(self.slots, 0)
        self._dropped = []  # May rejoin (once each).
        self._rejoined = set()

    def after_failure(self, slot):
        """Records that worker `slot` failed this attempt; returns whether and how the launch goes on.

        Args:
            slot: Integer, the failed worker's slot (its task index at the
                first attempt; `worker_slot` maps a task index to it).

        Returns:
            `Decision`. When `restart` is true, `slots` and `attempt` are those
            of the next attempt.
        """
        if not self.elastic:
            if self.attempt >= self.max_restarts:
                return Decision(False, f"no restart left (--max-restarts {self.max_restarts}).")
            self.attempt += 1
            return Decision(
                True,
                f"restarting all workers (restart {self.attempt} of {self.max_restarts}); "
                "a BackupAndRestore in fit resumes from its last backup.",
            )
        self._failures[slot] += 1
        rejoining = [s for s in self._dropped if s != slot and s not in self._rejoined]
        if self._failures[slot] <= self.max_restarts:
            self._dropped = [s for s in self._dropped if s not in rejoining]
            self._restart(rejoining)
            message = (
                f"restarting the workers (worker slot {slot}'s restart {self._failures[slot]} of "
                f"{self.max_restarts}); a BackupAndRestore in fit resumes from its last backup."
            )
            return Decision(True, message + self._rejoin_note(rejoining))
        remaining = [s for s in self.slots if s != slot]
        used = f"its {self.max_restarts} restart is used up" if self.max_restarts == 1 else None
        used = used or f"its {self.max_restarts} restarts are used up"
        if len(remaining) + len(rejoining) < self.min_workers:
            return Decision(
                False,
                f"worker slot {slot} failed {_times(self._failures[slot])} ({used}), and "
                f"{len(remaining)} worker{'s' if len(remaining) != 1 else ''} would remain, fewer than "
                f"--min-workers {self.min_workers}: stopping.",
            )
        failures = self._failures[slot]
        self._dropped = [s for s in self._dropped if s not in rejoining]
        if slot not in self._rejoined:
            self._dropped.append(slot)
        self._failures[slot] = self.max_restarts  # One more try if it rejoins.
        before = len(self.slots)
        self.slots = sorted(remaining)
        self._restart(rejoining)
        message = (
            f"worker slot {slot} failed {_times(failures)} ({used}): continuing with "
            f"{_workers(len(self.slots))} instead of {before} ({_slots(self.slots)}; --min-workers "
            f"{self.min_workers}). A BackupAndRestore in fit resumes from its last backup."
        )
        return Decision(True, message + self._rejoin_note(rejoining))

    def worker_slot(self, task_id):
        """Returns the slot that runs as worker `task_id` in this attempt."""
        return self.slots[task_id]

    def _restart(self, rejoining):
        self._rejoined.update(rejoining)
        self.slots = sorted(set(self.slots) | set(rejoining))
        self.attempt += 1

    def _rejoin_note(self, rejoining):
        if not rejoining:
            return ""
        names = ", ".join(str(s) for s in rejoining)
        return f" Worker slot{'s' if len(rejoining) > 1 else ''} {names} rejoin{'s' if len(rejoining) == 1 else ''} ({_slots(self.slots)})."


def _times(count):
    return f"{count} time{'s' if count != 1 else ''}"


def _workers(count):
    return f"{count} worker{'s' if count != 1 else ''}"


def _slots(slots):
    names = ", ".join(str(s) for s in slots)
    workers = "worker 0" if len(slots) == 1 else f"workers 0-{len(slots) - 1}"
    return f"slot{'s' if len(slots) > 1 else ''} {names} as {workers}"
