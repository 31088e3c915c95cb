"""A stand-in for a vLLM OpenAI server, for the router's failure paths that real engines cannot be made to take.

Usage: python fake_openai_server.py PORT [--refuse-continuations] [--delay S] [--announce] [--drop-after-finish]
       [--break-at-context L]

``/v1/completions`` (token-id prompts, streamed or not, ``return_token_ids``,
``stream_options.include_usage``) generates a deterministic "greedy" token
from the whole context: ``next = (31 * sum(context) + len(context)) % 500``,
so a request continued anywhere, from any prefix, goes on exactly as it
would have. ``--refuse-continuations`` answers 503 to a streamed request carrying
``kv_transfer_params`` (a destination that cannot take a moved request, though
it answered the move's warm-ups: one-token answers, not streamed).
``--announce`` puts ``kv_transfer_params`` in non-streamed answers, as a
prefill engine running HurrayConnector does. ``--delay S``: each token takes
S seconds, streamed or not. ``--drop-after-finish``: a stream's connection
breaks right after its finishing event, before ``[DONE]``. ``--break-at-context L``: a
stream whose prompt is shorter than L tokens breaks off once its context holds L tokens
(a backend dying at a known token; a continuation from there runs on). ``/health`` and ``/v1/models``
answer as vLLM's do (``max_model_len`` 4096); ``GET /seen`` lists every completion request's
``kv_transfer_params``. Token ``t``'s text is ``" w{t}"``. ``stop`` strings act as vLLM's: the
request finishes (``"stop"``, ``stop_reason``) at the token whose text completes one, its
text cut before it (after it with ``include_stop_str_in_output``), and a stream holds back
the last (longest stop string - 1) characters until they can start no stop string.
"""

# No ``from __future__ import annotations``: FastAPI reads ``request: Request`` at run time.
import asyncio
import json
import sys
from typing import Any


def next_token(context: list[int]) -> int:
    return (31 * sum(context) + len(context)) % 500


def main() -> None:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    port = int(sys.argv[1])
    refuse = "--refuse-continuations" in sys.argv
    delay = float(sys.argv[sys.argv.index("--delay") + 1]) if "--delay" in sys.argv else 0.01
    announce = "--announce" in sys.argv
    drop = "--drop-after-finish" in sys.argv
    break_at = int(sys.argv[sys.argv.index("--break-at-context") + 1]) if "--break-at-context" in sys.argv else 0
    app = FastAPI()

    seen: list[Any] = []  # every completion request's kv_transfer_params, in order

    @app.get("/seen")
    async def seen_params() -> Any:
        return JSONResponse(seen)

    @app.get("/health")
    async def health() -> Any:
        return JSONResponse({})

    @app.get("/v1/models")
    async def models() -> Any:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": 4096}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        if refuse and body.get("kv_transfer_params") and body.get("stream"):
            return JSONResponse({"error": {"message": "refusing continuations"}}, status_code=503)
        prompt = list(body["prompt"])
        n = int(body.get("max_tokens") or 16)

        def tokens() -> list[int]:
            ctx, out = list(prompt), []
            for _ in range(n):
                t = next_token(ctx)
                out.append(t)
                ctx.append(t)
            return out

        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        keep_stop = bool(body.get("include_stop_str_in_output"))

        def steps() -> list[tuple[int, str, str | None, str | None]]:
            """Each token with the text released with it, its finish reason and stop string."""
            hold = 0 if keep_stop or not stops else max(map(len, stops)) - 1
            text, sent, out = "", 0, []
            toks = tokens()
            for i, t in enumerate(toks):
                text += f" w{t}"
                # vLLM takes the stop string that completes first (ties: the first in the request's order).
                hits = sorted((text.find(s) + len(s), i, s) for i, s in enumerate(stops) if s and s in text)
                finish, stop = (None, None) if not hits else ("stop", hits[0][2])
                if stop is not None:
                    text = text[: text.find(stop) + (len(stop) if keep_stop else 0)]
                elif i == len(toks) - 1:
                    finish = "length"
                upto = len(text) if finish else max(sent, len(text) - hold)
                out.append((t, text[sent:upto], finish, stop))
                sent = upto
                if finish:
                    break
            return out

        seen.append(body.get("kv_transfer_params"))
        if not body.get("stream"):
            await asyncio.sleep(delay * n)
            done = steps()
            toks = [t for t, *_ in done]
            choice = {
                "index": 0,
                "text": "".join(x for _, x, _, _ in done),
                "finish_reason": done[-1][2],
                "stop_reason": done[-1][3],
                "token_ids": toks,
            }
            if body.get("return_token_ids"):
                choice["prompt_token_ids"] = prompt
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(toks),
                "total_tokens": len(prompt) + len(toks),
            }
            answer = {"id": "cmpl-fake", "object": "text_completion", "choices": [choice], "usage": usage}
            if announce:  # as HurrayConnector's request_finished says what it saved
                answer["kv_transfer_params"] = {"hurray_saved_tokens": len(prompt) // 64 * 64, "hurray_tail_tokens": 7}
            return JSONResponse(answer)

        async def events() -> Any:
            done = steps()
            for i, (t, text, finish, stop) in enumerate(done):
                if len(prompt) < break_at == len(prompt) + i:
                    await asyncio.sleep(0.2)  # the events before it reach the client first, then the connection breaks
                    raise ConnectionResetError("--break-at-context")  # a first leg breaks off here
                await asyncio.sleep(delay)
                choice = {"index": 0, "text": text, "token_ids": [t], "finish_reason": finish}
                if finish is not None:
                    choice["stop_reason"] = stop
                if i == 0:
                    choice["prompt_token_ids"] = prompt
                yield f"data: {json.dumps({'id': 'cmpl-fake', 'object': 'text_completion', 'choices': [choice]})}\n\n"
            if drop:
                raise ConnectionAbortedError("--drop-after-finish")  # uvicorn cuts the response off here
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(done),
                    "total_tokens": len(prompt) + len(done),
                }
                yield f"data: {json.dumps({'id': 'cmpl-fake', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
