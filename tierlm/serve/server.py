"""`tierlm serve`: an OpenAI-compatible HTTP server over the continuous batcher.

/v1/models, /v1/completions and /v1/chat/completions, with and without streaming (server-sent
events), the model's chat template, sampling parameters and usage counts. The batcher runs in its
own thread; each request's tokens come back to the event loop through an asyncio queue, so a slow
client never holds up the batch. Malformed requests get OpenAI's error shape with a 4xx status.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from ..infer.batcher import Request
from ..infer.sampling import SamplingParams
from ..storage import BudgetError
from .api import APIError, ChatBody, CompletionBody, _Body, chat_prompt, completion_prompt, error_json, sampling_of
from .options import ServeConfig
from .run import infer_config, load


def _fit_to_slot(p: SamplingParams, body: _Body, ids: list[int], max_len: int) -> None:
    if not isinstance(body, CompletionBody) or body.max_tokens is None:
        # chat (or no max_tokens): as many tokens as the slot has room for
        room = max_len - len(ids)
        if body.max_tokens is None and body.max_completion_tokens is None:
            p.max_tokens = max(1, min(p.max_tokens, room))


def _submit(batcher, ids: list[int], p: SamplingParams) -> tuple[Request, asyncio.Queue]:
    """Hand the request to the batcher's thread; its text and its end come back on the queue."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    req = Request(ids, p, on_text=lambda d: loop.call_soon_threadsafe(q.put_nowait, ("text", d)),
                  on_done=lambda r: loop.call_soon_threadsafe(q.put_nowait, ("done", r)))
    try:
        batcher.submit(req)
    except BudgetError as e:
        raise APIError(400, str(e), "max_tokens", "context_length_exceeded") from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return req, q


class _Reply:
    """The response's words for one request: its id, object type, choices and usage."""

    def __init__(self, req: Request, chat: bool, model_name: str):
        self.req, self.chat, self.model = req, chat, model_name
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.object = "chat.completion" if chat else "text_completion"

    def usage(self) -> dict:
        n, m = len(self.req.prompt_ids), len(self.req.out_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def choice(self, text: str, finish: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        key = "delta" if delta else "message"
        msg = ({"content": text} if text else {}) if delta else {"role": "assistant", "content": text}
        return {"index": 0, key: msg, "finish_reason": finish, "logprobs": None}


async def _whole(reply: _Reply, q: asyncio.Queue) -> dict:
    """The completion in one response, once the request is done."""
    req = reply.req
    try:
        while True:
            kind, _ = await q.get()
            if kind == "done":
                break
    finally:
        req.cancelled = req.finish_reason is None
    if req.finish_reason == "error":
        raise APIError(500, f"generation failed: {req.error}", type_="server_error")
    return {"id": reply.id, "object": reply.object, "created": int(time.time()), "model": reply.model,
            "choices": [reply.choice(req.text, req.finish_reason, False)], "usage": reply.usage()}


async def _events(reply: _Reply, q: asyncio.Queue, include_usage: bool):
    """The completion as server-sent events: a chunk a text delta, then the finish (and usage)."""
    req, chat = reply.req, reply.chat
    base = {"id": reply.id, "object": reply.object + (".chunk" if chat else ""), "created": int(time.time()),
            "model": reply.model}
    sse = lambda d: f"data: {json.dumps({**base, **d})}\n\n"
    try:
        if chat:
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None, "logprobs": None}]})
        while True:
            kind, v = await q.get()
            if kind == "text":
                yield sse({"choices": [reply.choice(v, None, True)]})
                continue
            if req.finish_reason == "error":
                yield f"data: {json.dumps({'error': {'message': req.error, 'type': 'server_error'}})}\n\n"
                break
            yield sse({"choices": [reply.choice("", req.finish_reason, True)]})
            if include_usage:
                yield sse({"choices": [], "usage": reply.usage()})
            break
        yield "data: [DONE]\n\n"
    finally:
        req.cancelled = req.finish_reason is None  # the client went away: free the slot


async def _respond(batcher, model_name: str, ids: list[int], p: SamplingParams, chat: bool, body: _Body):
    from fastapi.responses import StreamingResponse

    _fit_to_slot(p, body, ids, batcher.engine.max_len)
    req, q = _submit(batcher, ids, p)
    reply = _Reply(req, chat, model_name)
    if not body.stream:
        return await _whole(reply, q)
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(_events(reply, q, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _add_error_handlers(app) -> None:
    """Every error in OpenAI's shape: ours, a body that fails validation (400), and Starlette's."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_json(e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        msg = f"{loc}: {first.get('msg')}" if loc else str(first.get("msg", "invalid request"))
        return error_json(400, msg, loc)

    @app.exception_handler(HTTPException)
    async def _http(_, e: HTTPException):
        return error_json(e.status_code, str(e.detail), type_="invalid_request_error" if e.status_code < 500
                          else "server_error")


def make_app(batcher, tokenizer, model_name: str):
    from fastapi import FastAPI

    app = FastAPI(title="tierlm", docs_url=None, redoc_url=None)
    _add_error_handlers(app)
    created = int(time.time())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tierlm"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        p = sampling_of(body, model_name, batcher.engine.max_len)
        ids = completion_prompt(body, tokenizer, batcher.engine.config.vocab_size)
        return await _respond(batcher, model_name, ids, p, False, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        p = sampling_of(body, model_name, batcher.engine.max_len)
        ids = chat_prompt(body, tokenizer)
        return await _respond(batcher, model_name, ids, p, True, body)

    return app


def serve_cmd(args: ServeConfig) -> int:
    import sys
    from pathlib import Path

    import uvicorn

    cfg = infer_config(args, args.max_batch, None)
    eng, tok, batcher = load(args.model, cfg)
    name = args.served_model_name or Path(args.model).resolve().name
    app = make_app(batcher, tok, name)
    batcher.start()
    print(f"tierlm serve: {eng.describe()}\nserving {name!r} on http://{args.host}:{args.port}/v1 "
          f"({cfg.max_batch} sequences at once, {eng.max_len} positions each)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        batcher.stop()
        eng.close()
    return 0
