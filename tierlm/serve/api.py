"""The OpenAI API's side of `tierlm serve`: request bodies, errors in OpenAI's shape, and what a
request asks for (its sampling, its prompt's token ids), checked before it reaches the batcher."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..hf.tokenizer import chat_ids
from ..infer.sampling import SamplingParams


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


def error_json(status, message, param=None, code=None, type_="invalid_request_error"):
    from fastapi.responses import JSONResponse
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_,
                                                               "param": param, "code": code}})


def text_of(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for p in content:
        if p.get("type") != "text":
            raise APIError(400, f"message content part of type {p.get('type')!r} is not supported; "
                                "send text parts only", "messages")
        parts.append(p.get("text", ""))
    return "".join(parts)


def sampling_of(body: _Body, model_name: str, max_len: int) -> SamplingParams:
    """The request's sampling; a completion without max_tokens gets 16 (OpenAI's default), a chat
    as many as a KV slot holds (cut to the room its prompt leaves when it runs)."""
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                       "model", "model_not_found")
    if body.logprobs not in (None, False, 0):
        raise APIError(400, "logprobs are not supported", "logprobs")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    p = SamplingParams(max_tokens=body.max_completion_tokens or body.max_tokens or
                       (16 if isinstance(body, CompletionBody) else max_len),
                       temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                       seed=body.seed, stop=stop)
    try:
        p.check()
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return p


def completion_prompt(body: CompletionBody, tokenizer, vocab: int) -> list[int]:
    """The prompt's token ids: one string (alone or in a list of one) or a list of ids."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "prompt: one prompt per request (a list of one string, a string, "
                                "or a list of token ids)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer(prompt).input_ids
    else:
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
        ids = list(prompt)
    if not ids:
        raise APIError(400, "prompt: empty; give some text", "prompt")
    return ids


def chat_prompt(body: ChatBody, tokenizer) -> list[int]:
    """The conversation through the model's chat template ("developer" is OpenAI's "system")."""

    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    msgs = [{"role": "system" if m.role == "developer" else m.role, "content": text_of(m.content)}
            for m in body.messages]
    try:
        return chat_ids(tokenizer, msgs)
    except Exception as e:  # the template's own checks (roles, order) are the user's input errors
        raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None
