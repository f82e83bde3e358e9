"""Layer 2: what each worker is doing, for the stall watchdog and the step timeline.

Owns: this process's phases and finished steps (`_progress`), the stall watchdog
that names a worker the others wait for (`_stall`), and the Chrome-trace timeline
with its straggler report (`_timeline`). The hooks that write the phases sit in
layer 1 (keras_dist._model.monitoring).
"""
