"""A real OTLP/gRPC trace receiver: the collector end that Envoy's OpenTelemetry tracer
exports spans to.

The messages it decodes are declared here, in a descriptor pool of their own, with the field
numbers of OTLP's `trace.proto` and `trace_service.proto` (v1). Two wheels install modules under
`opentelemetry.proto`: `xds-protos` bundles an older OTLP (whose ResourceSpans calls field 2
`instrumentation_library_spans`) and `opentelemetry-proto` the current one (`scope_spans`), and
which one a fresh environment ends up with depends on the order pip installs them. A receiver
that owns its descriptors decodes the same bytes whatever is installed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PACKAGE = "kvpilot.tests.otlp"

F = descriptor_pb2.FieldDescriptorProto
# (message, [(field name, number, type, label, message type name or "")]): only what the
# tests read; every other field on the wire is kept as unknown and ignored.
MESSAGES: list[tuple[str, list[tuple[str, int, int, int, str]]]] = [
    (
        "AnyValue",
        [
            ("string_value", 1, F.TYPE_STRING, F.LABEL_OPTIONAL, ""),
            ("bool_value", 2, F.TYPE_BOOL, F.LABEL_OPTIONAL, ""),
            ("int_value", 3, F.TYPE_INT64, F.LABEL_OPTIONAL, ""),
            ("double_value", 4, F.TYPE_DOUBLE, F.LABEL_OPTIONAL, ""),
            ("bytes_value", 7, F.TYPE_BYTES, F.LABEL_OPTIONAL, ""),
        ],
    ),
    (
        "KeyValue",
        [
            ("key", 1, F.TYPE_STRING, F.LABEL_OPTIONAL, ""),
            ("value", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, "AnyValue"),
        ],
    ),
    ("Resource", [("attributes", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, "KeyValue")]),
    (
        "Span",
        [
            ("trace_id", 1, F.TYPE_BYTES, F.LABEL_OPTIONAL, ""),
            ("span_id", 2, F.TYPE_BYTES, F.LABEL_OPTIONAL, ""),
            ("parent_span_id", 4, F.TYPE_BYTES, F.LABEL_OPTIONAL, ""),
            ("name", 5, F.TYPE_STRING, F.LABEL_OPTIONAL, ""),
            ("attributes", 9, F.TYPE_MESSAGE, F.LABEL_REPEATED, "KeyValue"),
        ],
    ),
    ("ScopeSpans", [("spans", 2, F.TYPE_MESSAGE, F.LABEL_REPEATED, "Span")]),
    (
        "ResourceSpans",
        [
            ("resource", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, "Resource"),
            ("scope_spans", 2, F.TYPE_MESSAGE, F.LABEL_REPEATED, "ScopeSpans"),
        ],
    ),
    (
        "ExportTraceServiceRequest",
        [("resource_spans", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, "ResourceSpans")],
    ),
    ("ExportTraceServiceResponse", []),
]


def build_messages() -> dict[str, type[Message]]:
    """The message classes above, from a private descriptor pool."""
    file = descriptor_pb2.FileDescriptorProto(
        name="kvpilot/tests/otlp.proto", package=PACKAGE, syntax="proto3"
    )
    for name, fields in MESSAGES:
        message = file.message_type.add(name=name)
        if name == "AnyValue":
            message.oneof_decl.add(name="value")
        for field, number, kind, label, type_name in fields:
            message.field.add(
                name=field,
                number=number,
                type=kind,
                label=label,
                type_name=f".{PACKAGE}.{type_name}" if type_name else None,
                oneof_index=0 if name == "AnyValue" else None,
            )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name, _ in MESSAGES
    }


OTLP = build_messages()


def attribute_value(value: Any) -> Any:
    """An OTLP AnyValue as a Python value (None when its kind is not one declared here)."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class OtlpReceiver:
    """Collects every span exported to it; `port` is its OTLP/gRPC port on 127.0.0.1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[tuple[str, Any]] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler: Callable[[bytes, Any], bytes] = self._export
        self._server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    EXPORT_METHOD.split("/")[1],
                    {EXPORT_METHOD.split("/")[2]: grpc.unary_unary_rpc_method_handler(handler)},
                ),
            )
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def _export(self, body: bytes, context: Any) -> bytes:
        request = OTLP["ExportTraceServiceRequest"].FromString(body)
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        attribute_value(a.value)
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    self._spans.extend((service, span) for span in scope_spans.spans)
        return bytes(OTLP["ExportTraceServiceResponse"]().SerializeToString())

    @property
    def spans(self) -> list[tuple[str, Any]]:
        """(service.name, span) of every span received so far; a span has `trace_id`,
        `span_id`, `parent_span_id`, `name` and `attributes`."""
        with self._lock:
            return list(self._spans)

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)


def span_attributes(span: Any) -> dict[str, Any]:
    """A span's attributes as a dict."""
    return {a.key: attribute_value(a.value) for a in span.attributes}
