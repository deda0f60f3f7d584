"""The ``torchrun.handlers`` entry point of ``--rdzv_backend=ft`` (see pyproject.toml).

Kept apart from ``elastic.rendezvous`` and free of imports: torch loads entry points
while its rendezvous package is being imported, which ``elastic.rendezvous`` itself
imports, so the handler module is only imported when torchrun builds a handler.
"""

from __future__ import annotations


def handler_creator():
    """Called by torchrun with no argument; returns the creator it registers as ``ft``."""

    def create(params):
        from elastic.rendezvous import create_handler

        return create_handler(params)

    return create
