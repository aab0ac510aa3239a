"""The API server and its background loops (see docs/architecture.md).

The ASGI app is ``service.api.app:app`` (or ``create_app()``); nothing here is imported by
``service.cli``'s client commands.
"""
