"""Usage: what each key spent, computed by SQL over the ledger (the one record for disputes).

`BILLABLE_SQL` is the one definition of a request's cost, shared by the daily quota (at start-up,
and in memory through `quotas.QuotaBook.settle`) and by the reports: a request that reached the
engine (`admitted_at` set) costs its prompt tokens plus the tokens it emitted (for a request cut
off by a crash, what its row recorded as it ran); one that never reached the engine costs nothing.
A request belongs to the UTC day (and report window) of its `created_at`, and to the model its
`model` column names (the name the request used: a LoRA adapter's own name), which is what a
key's per-model limits count.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from server.serving.errors import InvalidRequest
from server.serving.ledger import Ledger

BILLABLE_SQL = "CASE WHEN admitted_at IS NULL THEN 0 ELSE prompt_tokens + completion_tokens END"
DAY_S = 86400.0

GROUPS = {
    "key": "COALESCE(key_id, '-')",
    "model": "COALESCE(model, '-')",
    "day": "date(created_at, 'unixepoch')",  # the backend's own spelling replaces it (day_sql)
}


async def daily_usage(ledger: Ledger, day: int) -> dict[str, int]:
    """Each key's billable tokens for the UTC day `day` (days since the epoch)."""
    rows = await ledger.query(
        f"SELECT key_id, SUM({BILLABLE_SQL}) FROM requests WHERE key_id IS NOT NULL "
        "AND created_at >= ? AND created_at < ? GROUP BY key_id", (day * DAY_S, (day + 1) * DAY_S))
    return {str(k): int(n or 0) for k, n in rows}


async def daily_usage_by_model(ledger: Ledger, day: int) -> dict[tuple[str, str], int]:
    """Each (key, model name the request used)'s billable tokens for the UTC day `day`: what the
    key's per-model daily quotas start a restarted server from."""
    rows = await ledger.query(
        f"SELECT key_id, model, SUM({BILLABLE_SQL}) FROM requests WHERE key_id IS NOT NULL AND model IS NOT NULL "
        "AND created_at >= ? AND created_at < ? GROUP BY key_id, model", (day * DAY_S, (day + 1) * DAY_S))
    return {(str(k), str(m)): int(n or 0) for k, m, n in rows}


async def recent_usage_by_model(ledger: Ledger, since: float) -> dict[tuple[str, str], list[tuple[float, int]]]:
    """`recent_usage` per (key, model name): the per-model TPM buckets' window."""
    rows = await ledger.query(
        f"SELECT key_id, model, created_at, {BILLABLE_SQL} FROM requests WHERE key_id IS NOT NULL "
        "AND model IS NOT NULL AND created_at >= ?", (since,))
    out: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for k, m, t, n in rows:
        out.setdefault((str(k), str(m)), []).append((float(t), int(n or 0)))
    return out


async def recent_usage(ledger: Ledger, since: float) -> dict[str, list[tuple[float, int]]]:
    """(created_at, billable tokens) of each key's requests created since `since` (the TPM window)."""
    rows = await ledger.query(
        f"SELECT key_id, created_at, {BILLABLE_SQL} FROM requests WHERE key_id IS NOT NULL AND created_at >= ?",
        (since,))
    out: dict[str, list[tuple[float, int]]] = {}
    for k, t, n in rows:
        out.setdefault(str(k), []).append((float(t), int(n or 0)))
    return out


def usage_query(start: Optional[float], end: Optional[float], group_by: str,
                key_id: Optional[str], day_sql: Optional[Callable[[str], str]] = None) -> tuple[str, tuple[Any, ...]]:
    """The report's SQL: per group, request count and token sums (billable included; reasoning
    tokens are the part of completion tokens the model spent thinking, OpenAI's
    `completion_tokens_details.reasoning_tokens`)."""
    if group_by not in GROUPS:
        raise InvalidRequest(f"group_by: expected one of {', '.join(GROUPS)}, got {group_by!r}", param="group_by")
    where: list[str] = []
    args: list[Any] = []
    if start is not None:
        where.append("created_at >= ?")
        args.append(start)
    if end is not None:
        where.append("created_at < ?")
        args.append(end)
    if key_id is not None:
        where.append("key_id = ?")
        args.append(key_id)
    g = day_sql("created_at") if group_by == "day" and day_sql is not None else GROUPS[group_by]
    sql = (f"SELECT {g} AS grp, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), "
           f"SUM(cached_tokens), SUM({BILLABLE_SQL}), SUM(COALESCE(reasoning_tokens, 0)) FROM requests"
           + (" WHERE " + " AND ".join(where) if where else "") + " GROUP BY grp ORDER BY grp")
    return sql, tuple(args)


def rows_to_report(rows: list[tuple[Any, ...]], group_by: str) -> list[dict[str, Any]]:
    return [{group_by: r[0], "requests": int(r[1]), "prompt_tokens": int(r[2] or 0),
             "completion_tokens": int(r[3] or 0), "reasoning_tokens": int(r[6] or 0),
             "cached_tokens": int(r[4] or 0), "billable_tokens": int(r[5] or 0)} for r in rows]


async def usage_report(ledger: Ledger, start: Optional[float], end: Optional[float], group_by: str,
                       key_id: Optional[str]) -> list[dict[str, Any]]:
    sql, args = usage_query(start, end, group_by, key_id, ledger.day_sql)
    return rows_to_report(await ledger.query(sql, args), group_by)


def usage_report_sync(conn: Any, start: Optional[float], end: Optional[float],
                      group_by: str, key_id: Optional[str]) -> list[dict[str, Any]]:
    """Over a sqlite3 connection or a PostgreSQL one (ledger_pg_sync.PgSyncConn)."""
    sql, args = usage_query(start, end, group_by, key_id, getattr(conn, "day_sql", None))
    return rows_to_report([tuple(r) for r in conn.execute(sql, args)], group_by)
