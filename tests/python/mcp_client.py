"""A real MCP client (PyPI mcp) driving `tracer mcp` over stdio; prints what it saw as JSON.

usage: mcp_client.py TRACER DB live|full|story|devices [QUERY_TIME]
       mcp_client.py TRACER DB export DIR
  live: the database a running trace is writing: sessions and one query.
  full: every tool and the prompt, and the refusals, with how long each refusal took.
  story: explain and the layout at the OOM, as an assistant would ask them.
  devices: the layout at the end.
  export: `tracer mcp --export-dir DIR`: export_snapshot at the OOM twice, and a bad bound.
"""
import asyncio
import json
import sys
import time

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


def text_of(result):
    return "".join(getattr(c, "text", "") for c in result.content)


async def call(session, name, args):
    started = time.monotonic()
    result = await session.call_tool(name, args)
    return {
        "is_error": bool(result.is_error),
        "structured": result.structured_content,
        "text": text_of(result),
        "seconds": time.monotonic() - started,
    }


async def main(tracer, db, mode, query_time):
    args = ["mcp", "--db", db]
    if mode == "export":
        args += ["--export-dir", query_time]
    elif query_time:
        args += ["--query-time", query_time]
    params = StdioServerParameters(command=tracer, args=args)
    out = {}
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            init = await session.initialize()
            out["server"] = init.server_info.name
            if mode == "live":
                out["sessions"] = await call(session, "sessions", {})
                out["count"] = await call(session, "query", {"sql": "SELECT count(*) AS n FROM events"})
                print(json.dumps(out))
                return
            if mode == "devices":
                out["layout_end"] = await call(session, "layout", {})
                print(json.dumps(out))
                return
            if mode == "story":
                out["explain"] = await call(session, "explain", {})
                out["layout_oom"] = await call(session, "layout", {"at": "oom"})
                print(json.dumps(out))
                return
            if mode == "export":
                out["first"] = await call(session, "export_snapshot", {"at": "oom"})
                out["second"] = await call(session, "export_snapshot", {"at": "oom"})
                out["bad"] = await call(session, "export_snapshot", {"max_entries": 0})
                print(json.dumps(out))
                return
            tools = await session.list_tools()
            out["tools"] = {
                t.name: {"output_schema": t.output_schema is not None, "description": t.description}
                for t in tools.tools
            }
            prompts = await session.list_prompts()
            out["prompts"] = [p.name for p in prompts.prompts]
            prompt = await session.get_prompt("investigate", {})
            out["prompt"] = "".join(m.content.text for m in prompt.messages)
            out["sessions"] = await call(session, "sessions", {})
            out["explain"] = await call(session, "explain", {})
            out["op_stats"] = await call(session, "op_stats", {"window_s": 2.0, "op": "cudaMalloc"})
            out["op_stats_page1"] = await call(session, "op_stats", {"window_s": 0.005})
            nxt = (out["op_stats_page1"]["structured"] or {}).get("next_from_s")
            if nxt is not None:
                out["op_stats_page2"] = await call(session, "op_stats", {"window_s": 0.005, "from_s": nxt})
            out["stacks"] = await call(session, "stacks", {"top": 5})
            out["layout_oom"] = await call(session, "layout", {"at": "oom"})
            out["whatif"] = await call(session, "whatif", {"conf": ["expandable_segments:True"]})
            out["export_off"] = await call(session, "export_snapshot", {"at": "oom"})
            out["query"] = await call(
                session,
                "query",
                {"sql": "SELECT op, count(*) AS n FROM events GROUP BY op ORDER BY op"},
            )
            refusals = {
                "write": {"sql": "DELETE FROM sessions"},
                "attach": {"sql": "ATTACH DATABASE '/tmp/tracer-mcp-attach.db' AS other"},
                "write_after_read": {"sql": "SELECT 1; DROP TABLE sessions"},
                "two_statements": {"sql": "SELECT 1; SELECT 2"},
                "pragma_write": {"sql": "PRAGMA user_version = 99"},
                "runaway": {
                    "sql": "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r"
                },
            }
            out["refused"] = {k: await call(session, "query", v) for k, v in refusals.items()}
            out["oversized_rows"] = await call(
                session,
                "query",
                {"sql": "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 100000) SELECT i FROM r", "max_rows": 100000},
            )
            out["oversized_bytes"] = await call(
                session,
                "query",
                {"sql": "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 400) SELECT i, printf('%.*c', 1000, 'x') AS pad FROM r", "max_rows": 500},
            )
            out["bad_session"] = await call(session, "explain", {"session": 999999})
            out["bad_op"] = await call(session, "op_stats", {"op": "rm -rf"})
            out["no_such_tool"] = None
            try:
                r = await session.call_tool("trace", {})
                out["no_such_tool"] = {"is_error": bool(r.is_error), "text": text_of(r)}
            except Exception as e:  # a protocol error: the client raises
                out["no_such_tool"] = {"raised": str(e)}
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None))
