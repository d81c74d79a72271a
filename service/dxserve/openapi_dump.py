"""Print the app's OpenAPI document (``make openapi`` writes it to openapi/openapi.json)."""

from __future__ import annotations

import json
import sys
import tempfile


def document() -> dict:
    from dxserve.http import create_app
    from dxserve.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        # documented as a server with a token: the document shows where one goes (a
        # server without one serves its own, without the bearer scheme)
        settings = Settings(
            store=tmp, compilation_cache="", functions=["dxserve.examples"], token="documented"
        )
        app = create_app(settings)
        spec = app.openapi()
        app.state.service.close()
        return spec


def main() -> None:
    json.dump(document(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
