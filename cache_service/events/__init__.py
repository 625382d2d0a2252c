"""KV events for routers: the core's change feed (`cache_service.core.events`), numbered, buffered and published.

`hub.EventHub` numbers and buffers the batches and hands them to WatchEvents watchers and to
`publisher.ZmqPublisher`; `wire` writes a record as vLLM's KV event map (ZMQ) or as the proto's `KvEvent`.
docs/design.md §5 (KV events for routers).
"""
