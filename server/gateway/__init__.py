"""The gateway layer: API keys, authentication, token quotas and rate limits, usage reports, the
batch tier (files, batches) and capacity planning.

It sits between the network edge (`server.api`) and the request service (`server.serving`): the
edge asks it who a caller is (`auth`), the service asks it whether a key may spend tokens
(`quotas`), and operators read usage from the ledger through it (`usage`). Keys live in the
ledger database (`keys`). The batch tier (`files`, `batch`, `http`) runs uploaded JSONL files
through the same request service at background priority; `plan` does the capacity arithmetic.
"""
