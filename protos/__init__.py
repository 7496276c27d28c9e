"""Generated protobuf modules and the .proto files of headrace.v1 (the gRPC issue fills this)."""
