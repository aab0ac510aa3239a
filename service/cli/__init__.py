"""The ``trainq`` command (``service.cli.main``): the client commands over HTTP
(``commands``, ``client``, ``output``, ``specfile``, ``errors``), plus the admin commands.

Light by contract: importing this package loads neither FastAPI, SQLAlchemy, Celery nor
torch (tests/cli/test_light_imports.py).
"""
