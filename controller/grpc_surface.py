"""Registers the controller's servicer on a gRPC server with two guarantees the generated code lacks.

1. An undecodable request (bytes that are not the method's protobuf message, or strings that are
   not UTF-8) answers INVALID_ARGUMENT saying so, where grpc's generated handlers answer a bare
   UNKNOWN/INTERNAL: the request deserializer returns a marker instead of raising, and the
   handler refuses the marker before the servicer sees it.
2. No error echoes a large input: every status detail the servicer sets goes through `clip`, which
   shortens any run of more than `MAX_ECHO` characters without whitespace (an id, an address, a
   token-sized blob) and caps the whole detail at `MAX_DETAIL` characters. Messages keep their
   advice; a 1 MB job id comes back as its first few dozen characters and "...".

It also counts every call by method and status code (`RpcCounts`, exported by the controller's
metrics as luwu_controller_rpcs_total).
"""

from __future__ import annotations

import asyncio
import re

import grpc
from google.protobuf.message import DecodeError

from luwu.proto import controller_pb2 as pb

SERVICE = "luwu.v1.Controller"
MAX_ECHO = 80  # characters of one user-supplied word an error may repeat
MAX_DETAIL = 600  # characters of a whole status detail
_LONG_WORD = re.compile(rf"\S{{{MAX_ECHO + 1},}}")


def clip(text: str) -> str:
    """`text` with every over-long word shortened and the whole capped (see the module doc)."""
    text = _LONG_WORD.sub(lambda m: m.group(0)[:MAX_ECHO - 3] + "...", str(text))
    return text if len(text) <= MAX_DETAIL else text[:MAX_DETAIL - 3] + "..."


class _Undecodable:
    def __init__(self, message_type, reason: str):
        self.type_name = message_type.DESCRIPTOR.full_name
        self.reason = reason


def _deserializer(message_type):
    def decode(data: bytes):
        try:
            return message_type.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return _Undecodable(message_type, str(exc))
    return decode


class _ClippingContext:
    """The servicer's context with `abort`/`set_details` clipped; everything else passes through."""

    def __init__(self, context):
        self._context = context

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def abort(self, code, details: str = "", trailing_metadata=()):
        return await self._context.abort(code, clip(details), trailing_metadata)

    def set_details(self, details: str) -> None:
        self._context.set_details(clip(details))


class RpcCounts:
    """Calls answered, by (method, status code name): updated on the server's event loop, read by the
    metrics thread (a dict copy under the GIL)."""

    def __init__(self):
        self.calls: dict[tuple[str, str], int] = {}

    def count(self, method: str, code: str) -> None:
        key = (method, code)
        self.calls[key] = self.calls.get(key, 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        return dict(self.calls)


_CODES = {c.value[0]: c.name for c in grpc.StatusCode}


def _code_name(context, default: str) -> str:
    """The status the call ended with (`context.code()`: a StatusCode, its number, or None if never set)."""
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - an implementation without code(): keep the default, never fail the call
        return default
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        return _CODES.get(code, str(code))
    return default


def _refuse_text(bad: _Undecodable, method: str) -> str:
    return (f"{method}: the request is not a valid {bad.type_name} message ({clip(bad.reason)}): send the "
            "serialized protobuf of proto/controller.proto")


def _unary(method: str, impl, counts: RpcCounts):
    async def handler(request, context):
        try:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse_text(request, method))
            reply = await impl(request, _ClippingContext(context))
        except asyncio.CancelledError:
            counts.count(method, "CANCELLED")
            raise
        except BaseException:
            counts.count(method, _code_name(context, "UNKNOWN"))
            raise
        counts.count(method, _code_name(context, "OK"))
        return reply
    return handler


def _stream(method: str, impl, counts: RpcCounts):
    async def handler(request, context):
        try:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse_text(request, method))
            async for item in impl(request, _ClippingContext(context)):
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            counts.count(method, "CANCELLED")
            raise
        except BaseException:
            counts.count(method, _code_name(context, "UNKNOWN"))
            raise
        counts.count(method, _code_name(context, "OK"))
    return handler


def add_controller_service(servicer, server: grpc.aio.Server, counts: RpcCounts | None = None) -> None:
    """Serve `servicer` (a `ControllerServicer`) on `server` as `luwu.v1.Controller`.

    Args:
        servicer: the implementation; every method of the service must exist on it.
        server: a `grpc.aio.Server` not yet started.
        counts: where to count the calls by method and status (default: not kept).

    Example:
        >>> add_controller_service(ControllerService(core, auth), server)
    """
    handlers = {}
    counts = counts if counts is not None else RpcCounts()
    for m in pb.DESCRIPTOR.services_by_name["Controller"].methods:
        request = pb.__dict__[m.input_type.name]
        response = pb.__dict__[m.output_type.name]
        impl = getattr(servicer, m.name)
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                _stream(m.name, impl, counts), request_deserializer=_deserializer(request),
                response_serializer=response.SerializeToString)
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                _unary(m.name, impl, counts), request_deserializer=_deserializer(request),
                response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
