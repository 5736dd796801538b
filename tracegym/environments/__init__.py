"""The built-in environments, one file each (plus the corpus generator of ``search`` and the
grading harness ``code_harness`` that ``code`` runs inside its sandbox).

They are registered by name in ``tracegym.envs.registry.BUILTIN_ENVS`` and imported only when made.
The env framework they build on (``Env``, ``ToolEnv``, the registry, ``check_env``) is ``tracegym.envs``.
"""
