"""The gateway layer: policy only. API keys, authentication, token quotas and rate limits, usage
reports, and the log redaction that keeps secrets out of every log line.

It sits between the network edge (`server.api`) and the request service (`server.serving`):
the edge asks it who a caller is (`auth`, applied by `server.api.auth_guard`), the service
reserves and settles a key's tokens (`quotas`, through the `server.serving.access.Quotas`
Protocol: the service does not import the gateway), and operators read usage from the ledger
through it (`usage`). Keys live in the ledger database (`keys`). `policy.Gateway` is one
process's policy, which the composition root (`server/serve.py`) hands to the Runtime and the app.
"""
