"""The OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions
(plain and SSE streaming), /metrics (Prometheus) and /health.

Handlers only parse, tokenize (in a thread) and wait on the engine's events; all model work happens
on the engine's worker. Every failure is answered in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import time
import uuid
from collections.abc import Callable

import uvicorn

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from jetflow.decoding.prompt import encode_prompt
from jetflow.decoding.result import GenerationResult
from jetflow.errors import InvalidRequestError
from jetflow.serve.engine import Engine, EngineStopped, QueueFull, StepFailed
from jetflow.serve.errors import APIError, bad_request
from jetflow.serve.metrics import Metrics
from jetflow.serve.protocol import GenerationRequest, parse_body, parse_request

MAX_BODY_BYTES = 1 << 20
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics", "/health")
CLIENT_GONE = "jetflow.client_gone"  # set in a request's ASGI scope when its client left mid-stream


def jetflow_stats(result: GenerationResult) -> dict:
    """The per-response extension field: how the speculative decoder did on this request."""
    s = result.stats
    return {"tau": s.get("tau"), "rounds": s.get("rounds"), "budget": s.get("budget"),
            "mean_tree_size": s.get("mean_tree_size"), "seconds": result.seconds,
            "tokens_per_s": result.tokens_per_s}


def create_app(engine: Engine, model_name: str, *, aliases: tuple[str, ...] = (), api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, metrics: Metrics | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        # uvicorn has stopped accepting and waited for open requests (up to its graceful timeout):
        # cancel whatever is left and stop the worker.
        await asyncio.to_thread(engine.shutdown, True, 30.0)

    app = FastAPI(title="JetFlow", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = metrics or engine.metrics or Metrics()
    app.add_middleware(Guard, api_key=api_key, metrics=metrics)
    models = {model_name, *aliases}
    target = engine.jetflow.target
    state = {"in_flight": 0}

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return error_response(e)

    @app.exception_handler(404)
    async def not_found(request, _e):
        return error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def bad_method(request, _e):
        return error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}"))

    @app.exception_handler(Exception)
    async def internal(_request, e: Exception):
        return error_response(APIError(500, f"internal error: {type(e).__name__}", type="server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if engine.failure is not None:  # the worker died: nothing will be answered (load balancers look here)
            return JSONResponse({"status": "failed", "model": model_name, "error": engine.failure}, status_code=503)
        return {"status": "ok", "model": model_name, "queue_depth": engine.queue_depth}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine.queue_depth, state["in_flight"]),
                                 media_type="text/plain; version=0.0.4")

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "jetflow"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(m) for m in sorted(models)]}

    @app.get("/v1/models/{name:path}")
    async def retrieve_model(name: str):
        if name not in models:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {', '.join(sorted(models))}",
                           code="model_not_found")
        return model_card(name)

    async def read_request(request: Request, kind: str) -> GenerationRequest:
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > max_body_bytes:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {max_body_bytes} bytes")
        raw = b""
        try:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > max_body_bytes:
                    raise APIError(413, f"request body exceeds the limit of {max_body_bytes} bytes")
        except ClientDisconnect:  # gone while sending its body: nothing to answer, not a server error
            raise ClientGone from None
        return parse_request(parse_body(raw, max_body_bytes), kind, models)

    def encode(req: GenerationRequest) -> tuple[list[int], int]:
        """Prompt ids and the completion budget, checked against the context."""
        try:
            ids = encode_prompt(target.tokenizer, req.prompt, chat=req.kind == "chat")
        except InvalidRequestError as e:
            raise bad_request(str(e), "messages" if req.kind == "chat" else "prompt") from None
        context = target.max_context
        if len(ids) >= context:
            raise bad_request(f"the prompt has {len(ids)} tokens; this model's context is {context} tokens",
                              "messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")
        room = context - len(ids)
        if req.max_tokens is not None and req.max_tokens > room:
            raise bad_request(f"{req.limit_name} {req.max_tokens} + prompt {len(ids)} tokens exceed this model's "
                              f"context of {context} tokens (at most {room} new tokens)", req.limit_name,
                              code="context_length_exceeded")
        return ids, req.max_tokens or room

    async def start(request: Request, kind: str):
        req = await read_request(request, kind)
        ids, max_tokens = await asyncio.to_thread(encode, req)
        try:
            job = engine.submit(ids, {"max_new_tokens": max_tokens, "temperature": req.temperature,
                                      "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed, "stop": req.stop})
        except QueueFull:
            raise APIError(429, f"the server is busy ({engine.queue_depth} requests queued); retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(engine.retry_after())}) from None
        except EngineStopped as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        return req, ids, job

    def finish(result: GenerationResult) -> None:
        metrics.generation(result.prompt_tokens, result.new_tokens, result.seconds, result.stats.get("tau"))
        metrics.cached_prompt(result.cached_prompt_tokens)  # both engines: counted as prompt_tokens is, when done

    def usage(result: GenerationResult) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.new_tokens,
                "total_tokens": result.prompt_tokens + result.new_tokens,
                "prompt_tokens_details": {"cached_tokens": result.cached_prompt_tokens}}  # (OpenAI's field)

    async def run_to_end(job, request: Request) -> GenerationResult:
        """The job's result; ClientGone (the job cancelled) when the client disconnects first: the
        server does not notice that for a plain response by itself, and would generate on for
        nobody, holding a batch slot (with --max-batch 1, the whole server) until max_tokens."""
        gone = asyncio.ensure_future(client_gone(request))
        try:
            while True:
                event = asyncio.ensure_future(job.events.get())
                await asyncio.wait((event, gone), return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    event.cancel()
                    raise ClientGone
                kind, payload = event.result()
                if kind == "done":
                    return payload
                if kind == "error":
                    raise payload
                if kind == "cancelled":
                    raise EngineStopped(payload)
        finally:
            gone.cancel()
            job.cancel()  # no-op when finished; stops the worker if this handler was abandoned

    async def generate(request: Request, kind: str):
        state["in_flight"] += 1
        try:
            try:
                req, ids, job = await start(request, kind)
            except ClientGone:
                return Response(status_code=499)
            if req.stream:
                progress = {"answered": False}
                return JobStream(stream_events(req, job, progress),
                                 lambda: stream_ended(job, request.scope, progress),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            try:
                result = await run_to_end(job, request)
            except ClientGone:
                metrics.cancel()
                return Response(status_code=499)  # nginx's "client closed request": sent to nobody, counted
            except EngineStopped as e:
                raise APIError(503, str(e), type="server_error", code="shutting_down") from None
            except StepFailed as e:  # the whole batch's step: not this request's fault
                raise APIError(500, str(e), type="server_error") from None
            except InvalidRequestError as e:
                raise bad_request(str(e)) from None
            finish(result)
            rid, created = _ids(kind)
            if kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                          "logprobs": None, "finish_reason": result.finish_reason}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
                obj = "text_completion"
            return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
                    "usage": usage(result), "jetflow": jetflow_stats(result)}
        finally:
            state["in_flight"] -= 1

    def stream_ended(job, scope: dict, progress: dict) -> None:
        """However a stream ended: one whose job was not answered lost its client (mid-stream, or
        before the stream began, when Starlette cancels it before its generator ever runs), so the
        job is cancelled, or it would generate for nobody, and the request counts as 499 although
        its 200 may have gone out."""
        if not progress["answered"]:
            job.cancel()
            metrics.cancel()
            scope[CLIENT_GONE] = True

    async def stream_events(req: GenerationRequest, job, progress: dict):
        rid, created = _ids(req.kind)
        obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        state["in_flight"] += 1

        def chunk(delta: dict | str | None, finish_reason=None, **extra) -> str:
            if req.kind == "chat":
                choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
            body = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice], **extra}
            return f"data: {json.dumps(body)}\n\n"

        try:
            if req.kind == "chat":
                yield chunk({"role": "assistant", "content": ""})
            while True:
                kind, payload = await job.events.get()
                if kind == "delta":
                    yield chunk({"content": payload} if req.kind == "chat" else payload)
                elif kind == "done":
                    finish(payload)
                    progress["answered"] = True  # (counted: a client leaving now does not cancel it)
                    yield chunk(None, payload.finish_reason, jetflow=jetflow_stats(payload))
                    if req.include_usage:
                        body = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
                                "usage": usage(payload)}
                        yield f"data: {json.dumps(body)}\n\n"
                    break
                else:  # error or cancellation inside the worker: report it in the stream, then end it
                    progress["answered"] = True
                    err = payload if isinstance(payload, Exception) else EngineStopped(payload)
                    status = 400 if isinstance(err, InvalidRequestError) else 503 if isinstance(
                        err, EngineStopped) else 500
                    yield f"data: {json.dumps(APIError(status, str(err), type='server_error').body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # (a client gone mid-stream: stream_ended cancels the job)
            state["in_flight"] -= 1

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    return app


class Guard:
    """Pure ASGI middleware (it must not buffer streams or hide client disconnects): API-key check on
    /v1/ routes, and a request count per endpoint and status."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"  # a bounded label set, whatever clients request
        status = {"code": 500}

        async def send_and_count(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.api_key is not None and path.startswith("/v1/"):
                auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
                if not given:
                    error = APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
                    return await JSONResponse(error.body(), 401)(scope, receive, send_and_count)
                if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                    error = APIError(401, "incorrect API key", code="invalid_api_key")
                    return await JSONResponse(error.body(), 401)(scope, receive, send_and_count)
            await self.app(scope, receive, send_and_count)
        finally:
            self.metrics.request(endpoint, 499 if scope.get(CLIENT_GONE) else status["code"])


class CleanExitServer(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown, so the process would
    die by the signal; here a clean shutdown exits with status 0. ``before_deadline``: called shortly
    before the graceful shutdown's time runs out (it cancels the requests still generating, so their
    streams end with an error event and ``[DONE]`` instead of being cut mid-response)."""

    def __init__(self, config: uvicorn.Config, before_deadline: Callable[[], None] | None = None):
        super().__init__(config)
        self.before_deadline = before_deadline

    async def shutdown(self, sockets=None) -> None:
        timeout, timer = self.config.timeout_graceful_shutdown, None
        if self.before_deadline is not None and timeout is not None:
            async def cut() -> None:
                await asyncio.sleep(max(0.0, timeout - min(1.0, timeout / 2)))
                await asyncio.to_thread(self.before_deadline)
            timer = asyncio.create_task(cut())
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self.handle_exit) for s in handled}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class JobStream(StreamingResponse):
    """A job's SSE response that calls ``on_end`` however it ends, also when it is cancelled before
    its body generator first runs (a closed, never-started generator runs no ``finally``), and at
    once when its client is gone (the generator itself may be closed only when collected)."""

    def __init__(self, content, on_end: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


class ClientGone(Exception):
    """The client disconnected before its answer (of a plain request), or while sending its body."""


async def client_gone(request: Request) -> None:
    """Returns when the client of ``request`` (its body already read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _ids(kind: str) -> tuple[str, int]:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
