"""The agent gateway: train the agent you already have through an OpenAI-compatible endpoint.

    agent ──HTTP──▶ server.py ──▶ Gateway.complete ──▶ sessions.py ──▶ batching.py ──▶ engine
    (openai)        auth, SSE      one chat turn       token in/out     every live episode's
                                                       rows, forks      calls: one engine call

`runner.AgentRunner` is an episode runner (rollout/episodes.py's protocol): for each of a step's P × G
episodes it opens a session (its own random key), hands the user's `run(client, row)` an `openai.OpenAI` (or
`AsyncOpenAI`) whose base URL and key address that session, waits for every agent (or its timeout), and turns
each session's token rows into Rollouts. Nothing the agent sends is re-tokenized where the policy sampled it.

The endpoint (server.py), on 127.0.0.1 and a free port:
    GET  /v1/models
    POST /v1/chat/completions   messages, tools, tool_choice, stop, max_tokens / max_completion_tokens,
                                temperature, top_p, seed, n=1, stream (+ stream_options.include_usage)
    POST /v1/reward             {"reward": r} the episode's reward, or {"reward": r, "turn": k} one turn's
Every request carries `Authorization: Bearer <session key>`; anything else is refused 401. Errors are
OpenAI-style objects ({"error": {"message", "type", "param", "code"}}): malformed JSON or fields 400, a body
over the limit 413, an ended session 409. A stream that fails after it began ends with an error chunk and
[DONE] (chat completions) or a `response.failed` event (the Responses API).

The hook for other wire formats (the Responses API, gateway/responses.py): one chat turn is

    Gateway.complete(session, request: ChatRequest) -> Iterator[TextDelta | ToolCallDelta | TurnDone]

`ChatRequest.parse(body)` validates a chat-completions body (raises GatewayError); a translation builds a
ChatRequest from its own format (`ChatRequest(messages=[...chat messages...], tools=[...chat tools...], ...)`)
and renders the events its own way. TextDelta.text is content as it is sampled; ToolCallDelta is one complete
parsed call (index, id, name, arguments as a JSON string); TurnDone carries the final `message` (the OpenAI
chat message dict exactly as the non-streamed reply gives it), `finish_reason` and `usage`. Concatenated, the
TextDeltas equal TurnDone.message["content"]. A translation registers its route with
`server.ROUTES[path] = handler(gateway, session, body) -> dict | Iterator[dict | tuple[str, dict] | str]` (a
dict is a JSON reply; an iterator is an SSE stream of `data:` dicts, `(event, data)` pairs or raw strings such
as "[DONE]").
"""

from grpo.gateway.wire import ChatRequest, GatewayError, TextDelta, ToolCallDelta, TurnDone

__all__ = ["ChatRequest", "GatewayError", "TextDelta", "ToolCallDelta", "TurnDone"]
