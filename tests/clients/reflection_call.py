"""A gRPC client written elsewhere, used as grpcurl uses a server: it knows no proto file, lists
the services by server reflection, builds ShouldRateLimit's request and response types from the
descriptors the server sends, and makes the call.

    python reflection_call.py HOST:PORT '<RateLimitRequest as proto3 JSON>' [calls]

Prints one JSON object: the services listed, and each call's response as proto3 JSON.
"""
import json
import sys

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"


def main():
    address, request_json = sys.argv[1], sys.argv[2]
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(database.get_services())
        method = descriptor_pool.DescriptorPool(database).FindServiceByName(
            SERVICE
        ).FindMethodByName("ShouldRateLimit")
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            f"/{SERVICE}/ShouldRateLimit",
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        request = json_format.Parse(request_json, request_type())
        responses = [
            json_format.MessageToDict(call(request, timeout=10)) for _ in range(calls)
        ]
    print(json.dumps({"services": services, "responses": responses}))


if __name__ == "__main__":
    main()
