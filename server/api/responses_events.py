"""The Responses API's typed stream events for one response, built from the request's deltas.

    response.created, response.in_progress                          (before any output)
    reasoning item:  output_item.added → content_part.added → reasoning_text.delta… →
                     reasoning_text.done → content_part.done → output_item.done
    message item:    output_item.added → content_part.added → output_text.delta… →
                     output_text.done → content_part.done → output_item.done
    function_call:   output_item.added → function_call_arguments.delta… →
                     function_call_arguments.done → output_item.done
    response.completed | response.incomplete | response.failed       (last)

Every event carries the next `sequence_number`. Items open in output order: the thinking first,
then the answer, then calls (the answer's text is read for calls through the request's tool
parser, the one the whole response uses, so the stream adds up to the whole response). An item
stays open until the request ends, and the items are closed in output order, which is what the
openai SDK's stream accumulator checks (same ids in `added`, `done` and the final response).
"""
from __future__ import annotations

from typing import Any, Optional

from server.api.responses_format import call_item, message_item, reasoning_item
from server.api.tool_output import ChatToolStream
from server.api.tools import ToolPlan


class ResponseEvents:
    def __init__(self, response_id: str, request_id: str, tools: ToolPlan) -> None:
        self.response_id = response_id
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # open or closed output items, in output order
        self._reasoning: Optional[int] = None  # output index of the reasoning item
        self._message: Optional[int] = None
        self._calls: dict[int, int] = {}  # call index in the parser → output index
        self._tool_stream = ChatToolStream(tools, request_id) if tools.active else None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _open(self, item: dict[str, Any], part: Optional[dict[str, Any]], out: list[dict[str, Any]]) -> int:
        index = len(self.items)
        self.items.append(item)
        shown = {**item, "status": "in_progress"}
        if "content" in item:
            shown["content"] = []
        out.append(self.event("response.output_item.added", output_index=index, item=shown))
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        return index

    def delta(self, reasoning: str, text: str, finish: Optional[str]) -> list[dict[str, Any]]:
        """Events for one delta of the request (its thinking and its answer text)."""
        out: list[dict[str, Any]] = []
        if reasoning:
            if self._reasoning is None:
                self._reasoning = self._open(reasoning_item(self.response_id, "", "in_progress"),
                                             {"type": "reasoning_text", "text": ""}, out)
            item = self.items[self._reasoning]
            item["content"][0]["text"] += reasoning
            out.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=self._reasoning, content_index=0, delta=reasoning))
        fields: dict[str, Any] = {"content": text} if text else {}
        if self._tool_stream is not None:
            fields, _ = self._tool_stream.delta(0, text, finish)
        content = fields.get("content") or ""
        if content:
            if self._message is None:
                self._message = self._open(message_item(self.response_id, "", "in_progress"),
                                           {"type": "output_text", "text": "", "annotations": [], "logprobs": []}, out)
            item = self.items[self._message]
            item["content"][0]["text"] += content
            out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self._message,
                                  content_index=0, delta=content, logprobs=[]))
        for call in fields.get("tool_calls") or []:
            k = call["index"]
            if k not in self._calls:
                fn = call.get("function") or {}
                self._calls[k] = self._open(call_item(self.response_id, k, call["id"], fn.get("name", ""), "",
                                                      "in_progress"), None, out)
            index = self._calls[k]
            args = (call.get("function") or {}).get("arguments") or ""
            if args:
                self.items[index]["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta", item_id=self.items[index]["id"],
                                      output_index=index, delta=args))
        return out

    def close(self, status: str) -> list[dict[str, Any]]:
        """Close every open item (status completed, or incomplete when cut by max_output_tokens)."""
        out: list[dict[str, Any]] = []
        for index, item in enumerate(self.items):
            if item["type"] == "reasoning":
                part = item["content"][0]
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"]))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
                item["status"] = "completed"
            elif item["type"] == "message":
                part = item["content"][0]
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
                item["status"] = status
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
                item["status"] = "completed"
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out
