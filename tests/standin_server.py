"""A stand-in OpenAI-compatible server (a TEST DOUBLE, not a real engine): FastAPI + uvicorn in a
thread. What it answers is chosen by the last user message:

* ``shape:NAME`` → the reply shape NAME from fixtures/reasoning_replies.json (hand-written shapes);
* ``think:FIELD`` (streamed) → five reasoning pieces in ``delta.FIELD`` 50 ms apart, then the reply, no usage;
* ``fail400`` → HTTP 400;  ``flaky429:KEY`` → HTTP 429 on the first request for KEY, then a reply;
* ``http500:KEY`` → HTTP 500 once; ``stall:KEY`` → the first reply waits 3 s; ``drop:KEY`` → the
  first reply's connection is cut mid-body;
* ``raw:NAME`` → a malformed 200 reply (``choices_empty``, ``content_list``, ``html``, ``broken_json``,
  ``no_finish``, ``ids_text``), or ``raw:401`` (echoing the Authorization header back, as some
  proxies do) / ``raw:404`` (unknown model);
* anything else → a plain reply without reasoning, echoing the prompt.

``/v1/models`` lists one model, ``stand-in``.

``/v1/completions`` (Magpie) answers a prompt by the request's seed: attempt ``i = seed mod
1000003`` gets "Explain topic i//2 in detail" (so pairs are duplicates), but every 5th attempt is
cut at the token limit and every 7th is too short to keep. Requests are kept in ``completions``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path

from fastapi import Request  # module level: FastAPI resolves the string annotations against module globals

from eagle3kit.core.engines import free_port

SHAPES = json.loads((Path(__file__).parent / "fixtures" / "reasoning_replies.json").read_text())


class AppThread:
    """A FastAPI app served by uvicorn in a daemon thread on a free port (context manager)."""

    def serve(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{type(self).__name__} did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=5)


class StandInServer(AppThread):
    def __init__(self):
        from fastapi import FastAPI
        from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

        self.hits: Counter = Counter()
        app = FastAPI()

        @app.get("/version")
        def version():
            return {"version": "stand-in-0"}

        @app.get("/v1/models")
        def models():
            return {"object": "list", "data": [{"id": "stand-in", "object": "model", "owned_by": "test"}]}

        self.completions: list[dict] = []

        @app.post("/v1/completions")
        async def completions(body: dict):
            self.completions.append(body)
            if body["prompt"] == "NULL":  # a broken server: text null
                return {
                    "id": "c",
                    "object": "text_completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [{"index": 0, "text": None, "finish_reason": "stop", "logprobs": None}],
                }
            i = body["seed"] % 1_000_003
            text, finish = f"Explain topic {i // 2} in detail, please.", "stop"
            if i % 5 == 4:
                text, finish = "An answer that runs past the", "length"
            elif i % 7 == 6:
                text = "Hi there"
            return {
                "id": "c",
                "object": "text_completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29},
            }

        @app.post("/v1/chat/completions")
        async def chat(body: dict, request: Request):
            text = body["messages"][-1]["content"]
            self.hits[text] += 1
            if text.startswith("raw:"):
                return self._raw(text[4:], body, request)
            if text == "fail400":
                return JSONResponse(
                    {"error": {"message": "bad request", "type": "invalid_request_error"}}, status_code=400
                )
            if text.startswith("stall") and self.hits[text] == 1:
                await asyncio.sleep(3.0)  # longer than the client's timeout
            if text.startswith("drop") and self.hits[text] == 1:

                def broken():
                    yield b'{"id": "x", "choi'
                    raise ConnectionResetError("stand-in drops the connection mid-reply")

                return StreamingResponse(broken(), media_type="application/json")
            if text.startswith("http500") and self.hits[text] == 1:
                return JSONResponse({"error": {"message": "internal"}}, status_code=500)
            if text.startswith("flaky429") and self.hits[text] == 1:
                return JSONResponse(
                    {"error": {"message": "slow down"}}, status_code=429, headers={"retry-after-ms": "10"}
                )
            if body.get("stream"):
                return self._stream(body, text)
            base = {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
            if text.startswith("shape:"):
                shape = SHAPES[text[6:]]
                return {**base, **shape}
            return {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": f"reply to {text}"},
                    }
                ],
            }

        def _stream(body, text):
            head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
            if text.startswith("shape:"):
                chunks = SHAPES[text[6:]]
            elif text.startswith(
                "think:"
            ):  # think:FIELD — 5 reasoning pieces in delta.FIELD, 50 ms apart, then the reply; no usage
                field = text[6:]
                chunks = [
                    {"choices": [{"index": 0, "delta": {field: f"step {i}. "}, "finish_reason": None}]}
                    for i in range(5)
                ]
                chunks += [
                    {
                        "choices": [
                            {"index": 0, "delta": {"content": "The answer is 4."}, "finish_reason": "stop"}
                        ]
                    }
                ]
            else:
                chunks = [
                    {
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"content": "reply "},
                                "finish_reason": None,
                                "token_ids": [7],
                            }
                        ]
                    },
                    {
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"content": f"to {text}"},
                                "finish_reason": "stop",
                                "token_ids": [8, 2],
                            }
                        ]
                    },
                    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}},
                ]

            def gen():
                for c in chunks:
                    if text.startswith("think:"):
                        time.sleep(0.05)
                    yield "data: " + json.dumps({**head, **c}) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        def _raw(name, body, request):
            base = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"]}
            ok = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "fine"}}
            if name == "401":
                return JSONResponse(
                    {
                        "error": {
                            "message": f"Incorrect API key provided: {request.headers.get('authorization')}"
                        }
                    },
                    status_code=401,
                )
            if name == "404":
                return JSONResponse(
                    {"error": {"message": f"The model `{body['model']}` does not exist."}}, status_code=404
                )
            if name == "html":
                return HTMLResponse("<html><body>proxy login</body></html>")
            if name == "broken_json":
                return Response('{"id": "x", "choices": [', media_type="application/json")
            bodies = {
                "choices_empty": {**base, "choices": []},
                "content_list": {
                    **base,
                    "choices": [{**ok, "message": {"role": "assistant", "content": [{"type": "text"}]}}],
                },
                "no_finish": {**base, "choices": [{**ok, "finish_reason": None}]},
                "ids_text": {**base, "choices": [{**ok, "token_ids": "1,2,3"}]},
            }
            return bodies[name]

        self._raw = _raw
        self._stream = _stream
        self.serve(app)
        self.url = f"http://127.0.0.1:{self.port}/v1"
