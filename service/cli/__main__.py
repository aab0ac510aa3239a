"""``python -m service.cli``: the ``trainq`` command."""

from service.cli.main import main

main()
