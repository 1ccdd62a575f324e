"""A Rate Limit Quota Service client written elsewhere, acting as Envoy's rate_limit_quota filter
does on the wire: it knows no proto file, finds StreamRateLimitQuotas and its message types by
server reflection, and sends reports on streams, one at a time, reading what each brings.

    python rlqs_client.py HOST:PORT '<streams as JSON>'

The streams: a list, each a list of RateLimitQuotaUsageReports as proto3 JSON. On each stream
every report waits for the server's answer (a response, or the stream's end) before the next
is sent. Prints one JSON object: per stream, the responses as proto3 JSON, and how it ended
(the status code's name and details, or "open" when the client ended it).
"""
import json
import queue
import sys

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

SERVICE = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"


def run_stream(call, request_type, reports):
    """Sends `reports` on one stream, each after the answer to the one before."""
    outgoing = queue.Queue()

    def requests():
        while True:
            report = outgoing.get()
            if report is None:
                return
            yield report

    answers = call(requests(), timeout=30)
    responses, ended = [], "open"
    try:
        for report in reports:
            outgoing.put(json_format.Parse(json.dumps(report), request_type()))
            responses.append(json_format.MessageToDict(next(answers)))
    except grpc.RpcError as error:
        ended = {"code": error.code().name, "details": error.details()}
    except StopIteration:
        ended = {"code": "OK", "details": ""}
    outgoing.put(None)
    return {"responses": responses, "ended": ended}


def main():
    address, streams = sys.argv[1], json.loads(sys.argv[2])
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(database.get_services())
        method = (
            descriptor_pool.DescriptorPool(database)
            .FindServiceByName(SERVICE)
            .FindMethodByName("StreamRateLimitQuotas")
        )
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        call = channel.stream_stream(
            f"/{SERVICE}/StreamRateLimitQuotas",
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        results = [run_stream(call, request_type, reports) for reports in streams]
    print(json.dumps({"services": services, "streams": results}))


if __name__ == "__main__":
    main()
