"""The OpenAI-compatible HTTP door of the router: routes, and what each call goes through.

Design note. The door is a translation at the edge, never a second client of the router's
gRPC port: a completion call is parsed into an `ApiRequest` (`requests.py`), checked
against the served model, and run as a `RouterSession` (`call.py`), so it takes the same
admission, priority queue, dispatch, failover, per-key limits, metrics and request logs as
a gRPC stream. Each HTTP call has one span, a child of the caller's ``traceparent`` if it
sent one, and the parent of the router's span of each of its requests. Every error leaves
through `errors.py`.

    POST /v1/chat/completions   messages (and tools) → a `Chat` the worker renders with its
                                template; tool calls parsed out of the answer
    POST /v1/completions        text or token ids (or a batch of them)
    POST /tokenize, /detokenize vLLM's: a prompt's token ids (and back), from a worker
    GET  /v1/models, /v1/models/{id}
    GET  /health                200 while a worker is in rotation and the router not draining
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.router.http import errors, tokenize
from headrace.router.http.auth import HttpAuth
from headrace.router.http.call import HttpCall
from headrace.router.http.models import ModelCatalog
from headrace.router.http.requests import ApiRequest, parse_chat, parse_completion
from headrace.router.http.responses import ResponseBuilder, encode
from headrace.router.router import Router
from headrace.router.session import RouterSession
from headrace.sdk import auth, tracing, wire
from headrace.sdk.credentials import Metadata
from headrace.sdk.errors import HeadraceError, InvalidArgumentError, UnavailableError
from headrace.sdk.streams import FlowLimits
from headrace.sdk.telemetry import NAMESPACE
from opentelemetry import trace
from prometheus_client import Counter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

T = TypeVar("T")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
#: How long a worker may take to tokenize (on the thread that tokenizes its prompts).
TOKENIZE_TIMEOUT_S = 30.0


class CallRecord:
    """A call's span and its count in ``http_requests{route, status}``."""

    def __init__(self, door: HttpDoor, request: Request, route: str) -> None:
        self.door, self.route = door, route
        parent = tracing.parent_context({}, request.headers.items())
        self.span = tracing.tracer().start_span(
            f"{request.method} {route}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": request.method, "http.route": route},
        )

    def status(self, code: int) -> None:
        self.span.set_attribute("http.response.status_code", code)
        self.door.requests.labels(route=self.route, status=str(code)).inc()

    def end(self) -> None:
        self.span.end()


class HttpDoor:
    def __init__(
        self,
        router: Router,
        flow: FlowLimits,
        key_check: auth.ApiKeyInterceptor | None,
        max_body_bytes: int,
    ) -> None:
        self.router = router
        self.flow = flow
        self.auth = HttpAuth(key_check)
        self.max_body_bytes = max_body_bytes
        self.models = ModelCatalog(router)
        self.requests = Counter(
            "http_requests",
            "Calls to the OpenAI-compatible HTTP door, by route and HTTP status.",
            ["route", "status"],
            namespace=NAMESPACE,
            subsystem="router",
            registry=router.metrics.registry,
        )
        routes = Starlette(
            routes=[
                Route(CHAT, self._endpoint(CHAT, self.chat), methods=["POST"]),
                Route(COMPLETIONS, self._endpoint(COMPLETIONS, self.completions), methods=["POST"]),
                Route("/v1/models", self._endpoint("/v1/models", self.list_models)),
                Route("/v1/models/{model:path}", self._endpoint("/v1/models/{id}", self.model)),
                Route(TOKENIZE, self._endpoint(TOKENIZE, self.tokenize), methods=["POST"]),
                Route(DETOKENIZE, self._endpoint(DETOKENIZE, self.detokenize), methods=["POST"]),
                Route("/health", self.health),
            ],
            exception_handlers={HTTPException: _http_exception, Exception: _unexpected},
        )
        self.app = errors.ErrorGuard(routes)

    def _endpoint(
        self, route: str, handler: Callable[[Request, CallRecord], Awaitable[Any]]
    ) -> Callable[[Request], Awaitable[Any]]:
        """``handler`` with its call recorded, and typed errors as OpenAI-shaped answers."""

        async def endpoint(request: Request) -> Any:
            record = CallRecord(self, request, route)
            try:
                answer = await handler(request, record)
            except Exception as error:  # a bug is a 500 here, never an exception for uvicorn
                answer = _error_response(errors.as_headrace_error(error))
            if isinstance(answer, HttpCall):
                return answer  # it records its status and ends the span itself
            record.status(answer.status_code)
            record.end()
            return answer

        return endpoint

    # --- completions --------------------------------------------------------------------

    async def chat(self, request: Request, record: CallRecord) -> HttpCall:
        caller = self._caller(request, CHAT)
        body = await self._json(request)
        info = await self.models.get()
        api = parse_chat(body, info.max_model_len, info.tool_call_parser)
        return await self._start(api, caller, record)

    async def completions(self, request: Request, record: CallRecord) -> HttpCall:
        caller = self._caller(request, COMPLETIONS)
        api = parse_completion(await self._json(request))
        return await self._start(api, caller, record)

    async def _start(
        self, api: ApiRequest, caller: auth.Caller | None, record: CallRecord
    ) -> HttpCall:
        """Submit the call's requests (one per prompt) on a session of its own."""
        info, adapter = await self.models.check(api.model)
        api.check_context(info.max_model_len)
        builder = ResponseBuilder(api, adapter or info.name)
        session = RouterSession(self.router, self.flow, (), caller=caller)
        trace_context = tracing.carrier(record.span)
        for request_id, prompt in zip(builder.request_ids, api.prompts, strict=True):
            model = "" if adapter else api.model  # an adapter's name is not the worker's model
            request = wire.request_to_wire(
                request_id, prompt, api.config, api.priority, None, model
            )
            request.adapter = adapter
            # Continuous usage counts the prompt's tokens: its first chunk brings them.
            request.return_prompt_token_ids = api.continuous_usage
            request.trace_context.update(trace_context)
            session.submit(request)
            if request_id not in session.requests:
                break  # refused: the call fails with its error
        session.end_input()
        return HttpCall(api, session, builder, record)

    def _caller(self, request: Request, route: str) -> auth.Caller | None:
        peer = f"{request.client.host}:{request.client.port}" if request.client else "unknown"
        return self.auth.caller(request.headers.get("authorization"), f"POST {route}", peer)

    async def _json(self, request: Request) -> Any:
        """The body as JSON, refused (413) past the size limit before it is all read."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise errors.BodyTooLargeError("", self._too_large())
        parts, num_bytes = [], 0
        async for part in request.stream():
            num_bytes += len(part)
            if num_bytes > self.max_body_bytes:
                raise errors.BodyTooLargeError("", self._too_large())
            parts.append(part)
        try:
            return json.loads(b"".join(parts))
        except ValueError as error:
            raise InvalidArgumentError("", f"the body is not valid JSON: {error}") from None
        except RecursionError:
            raise InvalidArgumentError("", "the body's JSON is nested too deeply") from None

    def _too_large(self) -> str:
        return f"the request body is over {self.max_body_bytes} bytes"

    # --- tokens -------------------------------------------------------------------------

    async def tokenize(self, request: Request, record: CallRecord) -> Response:
        self._caller(request, TOKENIZE)
        call = tokenize.parse_tokenize(await self._json(request))
        model = await self._worker_model(call.model)
        wire_request = wire.tokenize_request_to_wire(call.prompt, call.add_special_tokens, model)
        response: pb.TokenizeResponse = await self._ask_a_worker(
            lambda stub, metadata: stub.Tokenize(
                wire_request, timeout=TOKENIZE_TIMEOUT_S, metadata=metadata
            )
        )
        return JSONResponse(tokenize.tokenize_body(response))

    async def detokenize(self, request: Request, record: CallRecord) -> Response:
        self._caller(request, DETOKENIZE)
        model, token_ids = tokenize.parse_detokenize(await self._json(request))
        wire_request = pb.DetokenizeRequest(model=await self._worker_model(model))
        wire_request.token_ids.extend(token_ids)
        response: pb.DetokenizeResponse = await self._ask_a_worker(
            lambda stub, metadata: stub.Detokenize(
                wire_request, timeout=TOKENIZE_TIMEOUT_S, metadata=metadata
            )
        )
        return JSONResponse({"prompt": response.text})

    async def _worker_model(self, model: str) -> str:
        """The model to name to a worker: "" for a LoRA adapter (which shares the base
        model's tokenizer); an unknown name is a 404."""
        _, adapter = await self.models.check(model)
        return "" if adapter else model

    async def _ask_a_worker(
        self, call: Callable[[generation_pb2_grpc.GenerationStub, Metadata], Awaitable[T]]
    ) -> T:
        """`Router.ask_a_worker`, a worker's refusal naming the body's field."""
        try:
            return await self.router.ask_a_worker(call)
        except InvalidArgumentError as error:
            message = str(error).removeprefix(f"{error.field}: ")
            raise InvalidArgumentError(tokenize.openai_param(error.field), message) from None

    # --- models and health --------------------------------------------------------------

    async def list_models(self, request: Request, record: CallRecord) -> Response:
        self._caller(request, "/v1/models")
        info = await self.models.get()
        adapters = sorted(await self.models.adapters())
        data = [self.models.describe(info, name) for name in ["", *adapters]]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request, record: CallRecord) -> Response:
        self._caller(request, "/v1/models")
        info, adapter = await self.models.check(request.path_params["model"])
        return JSONResponse(self.models.describe(info, adapter))

    async def health(self, request: Request) -> Response:
        """Open, like gRPC health: for probes and load balancers."""
        if self.router.draining:
            return _error_response(UnavailableError("the router is draining"))
        if not self.router.has_healthy_worker:
            return _error_response(UnavailableError("no healthy worker takes requests"))
        return JSONResponse({"status": "serving", "time": int(time.time())})


def _error_response(error: HeadraceError) -> Response:
    answer = errors.http_error(error)
    return Response(
        encode(errors.error_body(error)),
        answer.status,
        headers=errors.retry_after(error),
        media_type="application/json",
    )


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no such path) and 405, in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        error: HeadraceError = errors.MethodNotAllowedError(f"{request.method} is not allowed")
    else:
        error = errors.RouteNotFoundError(f"no such path: {request.url.path}")
    return _error_response(error)


async def _unexpected(request: Request, exc: Exception) -> Response:
    return _error_response(errors.as_headrace_error(exc))
