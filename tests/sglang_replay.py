"""A TEST DOUBLE of an SGLang 0.5 server, replaying the hand-written responses of
fixtures/sglang_responses.json (no SGLang server runs on this CPU-only machine; the fixture says
which SGLang source files its shapes follow). It answers ``/v1/models``, ``/server_info``,
``/metrics`` and ``/v1/chat/completions`` for the three prompts ``PROMPTS``: streamed replies of
12 tokens (usage in the last chunk), and without streaming each prompt's fixed ``meta_info``. Like
SGLang, it refuses ``return_meta_info`` on a streamed request (HTTP 400) and has no ``/tokenize``
for chat messages; ``usage.prompt_tokens`` is the length of the real SmolLM2 template's render."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from fastapi import Request  # module level: FastAPI resolves the string annotations against module globals
from standin_server import AppThread

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sglang_responses.json").read_text())
PROMPTS = ["Name three primary colours.", "What is the capital of France?", "Count from one to five."]
MODEL = "SmolLM2-135M-Instruct"


class SGLangReplay(AppThread):
    def __init__(self, tokenizer):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

        from eagle3kit.data.backends import render_prompt_ids

        self.seen: Counter = Counter()
        app = FastAPI()

        @app.get("/v1/models")
        def models():
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "sglang"}]}

        @app.get("/server_info")
        def server_info():
            return FIXTURE["server_info"]

        @app.get("/metrics")
        def metrics():
            return PlainTextResponse(FIXTURE["metrics"])

        @app.post("/v1/chat/completions")
        async def chat(body: dict, request: Request):
            stream, meta = bool(body.get("stream")), bool(body.get("return_meta_info"))
            self.seen["stream" if stream else "plain"] += 1
            if stream and meta:
                self.seen["refused"] += 1
                return JSONResponse(FIXTURE["stream_refusal"], status_code=400)
            i = PROMPTS.index(body["messages"][-1]["content"])
            usage = {
                "prompt_tokens": len(render_prompt_ids(tokenizer, body["messages"])),
                "completion_tokens": 12,
                "total_tokens": 0,
            }
            head = {"id": f"r{i}", "created": 0, "model": MODEL}
            if not stream:
                choice = {
                    "index": 0,
                    "finish_reason": "length",
                    "message": {
                        "role": "assistant",
                        "content": "one two three four five six seven eight nine ten eleven twelve",
                    },
                }
                if meta:
                    choice["meta_info"] = FIXTURE["meta_info_by_prompt"][i]
                return {**head, "object": "chat.completion", "choices": [choice], "usage": usage}

            def gen():
                words = "one two three four five six seven eight nine ten eleven twelve".split()
                for j in range(0, 12, 3):  # three tokens a chunk, as a speculative server streams them
                    delta = {"content": " ".join(words[j : j + 3]) + " "}
                    yield (
                        "data: "
                        + json.dumps(
                            {
                                **head,
                                "object": "chat.completion.chunk",
                                "choices": [
                                    {
                                        "index": 0,
                                        "delta": delta,
                                        "finish_reason": "length" if j == 9 else None,
                                    }
                                ],
                            }
                        )
                        + "\n\n"
                    )
                yield (
                    "data: "
                    + json.dumps({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
                    + "\n\n"
                )
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        self.serve(app)
        self.url = f"http://127.0.0.1:{self.port}"
