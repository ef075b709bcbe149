"""The OpenAI-compatible HTTP server: `build_app(async_llm, served_model_name, api_key)`."""

from fulcrum.server.api_server import BackgroundServer, build_app

__all__ = ["build_app", "BackgroundServer"]
