"""The serving layer between the network edge (`server.api`) and the engine thread: settings,
the Runtime that owns a process's parts, admission, the request ledger, per-request jobs and
streams, the engine bridge, the batch tier (`batch`, `files`) and the one request path every
edge shares (`service`). It imports neither the edge nor the gateway (`access` names what it
needs of the gateway); the process is put together in `server/serve.py`."""
