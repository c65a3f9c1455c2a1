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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..storage import BudgetError
from .batcher import Request
from .sampling import SamplingParams


class _Body(BaseModel):
    # Fields OpenAI clients send that change nothing here are accepted and ignored.
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: Any = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int]
    echo: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _error_json(status, message, param=None, code=None, type_="invalid_request_error"):
    from fastapi.responses import JSONResponse
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_,
                                                               "param": param, "code": code}})


def _text_of(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for p in content:
        if p.get("type") != "text":
            raise APIError(400, f"message content part of type {p.get('type')!r} is not supported; "
                                "send text parts only", "messages")
        parts.append(p.get("text", ""))
    return "".join(parts)


def make_app(batcher, tokenizer, model_name: str):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="tierlm", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return _error_json(e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        msg = f"{loc}: {first.get('msg')}" if loc else str(first.get("msg", "invalid request"))
        return _error_json(400, msg, loc)

    @app.exception_handler(HTTPException)
    async def _http(_, e: HTTPException):
        return _error_json(e.status_code, str(e.detail), type_="invalid_request_error" if e.status_code < 500
                           else "server_error")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tierlm"}]}

    def params_of(body: _Body) -> SamplingParams:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found")
        if body.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", "logprobs")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        p = SamplingParams(max_tokens=body.max_completion_tokens or body.max_tokens or
                           (16 if isinstance(body, CompletionBody) else batcher.engine.max_len),
                           temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                           seed=body.seed, stop=stop)
        try:
            p.check()
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return p

    async def run(ids: list[int], p: SamplingParams, chat: bool, body: _Body):
        if not isinstance(body, CompletionBody) or body.max_tokens is None:
            # chat (or no max_tokens): as many tokens as the slot has room for
            room = batcher.engine.max_len - len(ids)
            if body.max_tokens is None and body.max_completion_tokens is None:
                p.max_tokens = max(1, min(p.max_tokens, room))
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
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(req.out_ids),
                         "total_tokens": len(ids) + len(req.out_ids)}

        def choice(text, finish, delta: bool):
            if not chat:
                return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            key = "delta" if delta else "message"
            msg = ({"content": text} if text else {}) if delta else {"role": "assistant", "content": text}
            return {"index": 0, key: msg, "finish_reason": finish, "logprobs": None}

        if not body.stream:
            try:
                while True:
                    kind, v = await q.get()
                    if kind == "done":
                        break
            finally:
                req.cancelled = req.finish_reason is None
            if req.finish_reason == "error":
                raise APIError(500, f"generation failed: {req.error}", type_="server_error")
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                    "choices": [choice(req.text, req.finish_reason, False)], "usage": usage()}

        include_usage = bool((body.stream_options or {}).get("include_usage"))

        async def events():
            base = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": int(time.time()),
                    "model": model_name}
            sse = lambda d: f"data: {json.dumps({**base, **d})}\n\n"
            try:
                if chat:
                    yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None, "logprobs": None}]})
                while True:
                    kind, v = await q.get()
                    if kind == "text":
                        yield sse({"choices": [choice(v, None, True)]})
                        continue
                    if req.finish_reason == "error":
                        yield f"data: {json.dumps({'error': {'message': req.error, 'type': 'server_error'}})}\n\n"
                        break
                    yield sse({"choices": [choice("", req.finish_reason, True)]})
                    if include_usage:
                        yield sse({"choices": [], "usage": usage()})
                    break
                yield "data: [DONE]\n\n"
            finally:
                req.cancelled = req.finish_reason is None  # the client went away: free the slot

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        p = params_of(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "prompt: one prompt per request (a list of one string, a string, "
                                    "or a list of token ids)", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = tokenizer(prompt).input_ids
        else:
            vocab = batcher.engine.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
            ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt: empty; give some text", "prompt")
        return await run(ids, p, False, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        from ..hf.tokenizer import chat_ids

        p = params_of(body)
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": _text_of(m.content)}
                for m in body.messages]
        try:
            ids = chat_ids(tokenizer, msgs)
        except Exception as e:  # the template's own checks (roles, order) are the user's input errors
            raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None
        return await run(ids, p, True, body)

    return app


def serve_cmd(args) -> int:
    import sys

    import uvicorn

    from .run import infer_config, load

    cfg = infer_config(args, args.max_batch, None)
    eng, tok, batcher = load(args.model, cfg)
    name = args.served_model_name or __import__("pathlib").Path(args.model).resolve().name
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
