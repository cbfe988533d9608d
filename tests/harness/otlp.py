"""A real OTLP/gRPC trace receiver: the collector end that Envoy's OpenTelemetry tracer
exports spans to, built from the OpenTelemetry protos' own service stubs."""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


def attribute_value(value: Any) -> Any:
    """An OTLP AnyValue as a Python value."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every span exported to it; `port` is its OTLP/gRPC port on 127.0.0.1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[tuple[str, trace_pb2.Span]] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
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
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[tuple[str, trace_pb2.Span]]:
        """(service.name, span) of every span received so far."""
        with self._lock:
            return list(self._spans)

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)


def span_attributes(span: trace_pb2.Span) -> dict[str, Any]:
    """A span's attributes as a dict."""
    return {a.key: attribute_value(a.value) for a in span.attributes}
