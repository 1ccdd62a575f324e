"""An OTLP trace receiver for the tests, on OpenTelemetry's own service definitions (PyPI
opentelemetry-proto): TraceService/Export over gRPC, and POST /v1/traces (HTTP/protobuf).

    python otlp_receiver.py GRPC_PORT HTTP_PORT [--delay SECONDS]

Prints "ready" once both listen, then one JSON object per span received, a line each:
trace_id, span_id, parent_span_id (hex, "" for none), name, kind, the service.name of its
resource, its attributes (string values as text, others as their JSON), and the protocol it came
by. With --delay, each export is answered that many seconds late (a slow collector).
"""
import argparse
import json
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

LOCK = threading.Lock()


def value_of(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "string_value":
        return any_value.string_value
    if kind is None:
        return None
    return getattr(any_value, kind)


def report(request, protocol):
    lines = []
    for resource_spans in request.resource_spans:
        service = ""
        for attribute in resource_spans.resource.attributes:
            if attribute.key == "service.name":
                service = attribute.value.string_value
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                lines.append(
                    json.dumps(
                        {
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "name": span.name,
                            "kind": span.kind,
                            "service": service,
                            "attributes": {
                                a.key: value_of(a.value) for a in span.attributes
                            },
                            "protocol": protocol,
                        }
                    )
                )
    with LOCK:
        for line in lines:
            print(line)
        sys.stdout.flush()


class Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, delay):
        self.delay = delay

    def Export(self, request, context):
        time.sleep(self.delay)
        report(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


def http_handler(delay):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            time.sleep(delay)
            report(request, "http")
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("grpc_port", type=int)
    parser.add_argument("http_port", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(args.delay), server)
    server.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", args.http_port), http_handler(args.delay))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    print("ready")
    sys.stdout.flush()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
