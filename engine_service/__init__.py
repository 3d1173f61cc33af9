"""The engine worker: a process of its own that hosts one engine from engines/ and serves it over a small,
versioned streaming protocol (protocol.py), so a gateway's packet clock never shares an interpreter with
synthesis threads, and several gateways can share GPU hosts."""
