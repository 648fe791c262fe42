"""The controller's protobuf/gRPC API and its generated stubs."""
