"""One module per ``tracegym`` subcommand.

Each module defines ``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. ``tracegym.cli`` discovers them, so adding a command touches no other file.
Modules import heavy libraries (torch, transformers) inside ``run`` so ``tracegym --help`` is fast.
"""
