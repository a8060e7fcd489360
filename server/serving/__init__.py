"""The serving layer between the network edge (`server.api`) and the engine thread:
settings and process start-up, admission, the request ledger, per-request jobs and streams,
the engine bridge and the one request path both edges share (`service`)."""
