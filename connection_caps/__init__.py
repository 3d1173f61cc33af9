"""Caps for connection-oriented listeners, shared by the gateway and the engine workers (a package below both):
`budget` counts (connections in total and per source, the process's descriptor budget), `listener` applies them
to an aiohttp server. Never imports the gateway, the engines or the engine service."""
