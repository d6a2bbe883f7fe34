"""The gRPC transport: `service` (protobuf framing around the request core), `wire`
(authentication interceptor, status mapping), `workers` (executor use off the loop)."""
