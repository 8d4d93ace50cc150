"""User-facing entry points: the ``rayeval`` CLI and (later) the REST service. Never imports torch
at module level; heavy work is delegated to ``service``.
"""
