"""The HTTP surface: the routers of the native API, the Tinker API, the OpenAI-compatible API, the
signed download links and the dashboard, with what they share (the error table, the key
dependency, the request limits). Routers speak to the :class:`~twinkle.server.service.Service`
only; what runs the models is below it, in :mod:`twinkle.server.execution`."""
