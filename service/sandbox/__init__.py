"""Model-written code runs here, and nowhere else: bubblewrap sandboxes and the code_eval metric.

- :mod:`.bwrap` -- one sandbox per candidate (no network, private ``/tmp``, read-only interpreter,
  scrubbed environment, unprivileged uid, rlimits; nothing left running).
- :mod:`.code_eval` -- HF evaluate's ``code_eval`` execution module, pinned by sha256.
- :mod:`.metric` -- the ``code_eval`` metric lm-eval's code tasks load, run through the sandbox.
- ``inside.py`` -- the program that starts each candidate inside the sandbox (standard library).
"""
