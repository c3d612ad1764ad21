"""``python -m qlm.cli``: the ``qlm`` command (how the service starts ``qlm sim-engine serve``)."""

from qlm.cli import main

main()
