"""The HTTP layer: parses, routes and encodes; never differentiates."""

from .app import create_app

__all__ = ["create_app"]
