//! KV event sources: vLLM and SGLang over ZMQ, Dynamo over NATS, trace replay.
