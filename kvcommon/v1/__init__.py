"""Generated gRPC stubs for the kvcommon.v1 wire contract (see proto/, scripts/gen_proto.py)."""
