"""OpenAI-compatible HTTP server: `build_app(engine, ...)` and `serve(app, ...)`."""

from tidal.server.app import build_app, serve

__all__ = ["build_app", "serve"]
