"""Code both sides need, small: the pool's layout (`layout`), the pool socket's protocol
(`pool_socket`), the CUDA driver calls behind the fd-handed GPU pool (`cuda_driver`), the reading of a
model's layout from its Hugging Face config (`model`), hand-written protobuf wire pieces (`protowire`),
the service's addresses as users type them (`target`) and how a channel to it is set up (`channel`: keepalive,
limits, TLS files; the caller hands in grpc). `stats` is generated from the proto: GetStats' records, which
the core fills and the client reads.

The service (`cache_service`) and the engine client (`engine_client`) both import it; it imports neither,
nor the generated `protos` package (an import contract in pyproject.toml). Importing it costs nothing:
no protobuf, numpy or torch.
"""
