"""trainq's own programs, one subpackage each.

- ``service.api``: the API server (FastAPI) and its background loops: the ingestor, the
  reconciler, the dispatcher. It owns the SQL store and is its only writer.
- ``service.cli``: the ``trainq`` command. Its client side speaks HTTP and never imports the
  server; its admin commands (``db``, ``token``, ``api``, ``worker``) load what they need lazily.
- ``service.local``: ``trainq up``, the whole system on one machine.

This file imports nothing, so ``import service.cli`` stays light.
"""
