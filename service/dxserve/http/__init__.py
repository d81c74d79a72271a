"""The HTTP layer: parses, routes and encodes; never differentiates."""

from dxserve.http.app import create_app

__all__ = ["create_app"]
