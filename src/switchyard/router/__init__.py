"""The request router: an OpenAI-compatible front door that places each request on an engine."""
