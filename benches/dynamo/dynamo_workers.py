"""Dynamo's worker side of the bench: one process, one Dynamo "worker" per stream-engine.

Usage:
  dynamo_workers.py [--model bench-model] [--total-kv-blocks 20000] \
      --engine 256=tcp://127.0.0.1:P0 --engine 257=tcp://127.0.0.1:P1 ...

Each `--engine LABEL=ZMQ_PUB_ENDPOINT` becomes one Dynamo worker: its own DistributedRuntime
(so its own instance id), its own model card (aggregated, 16-token blocks) on
`--endpoint`, and a `KvEventPublisher` in relay mode that subscribes (SUB, topic `--topic`,
default `kv-events`) to that stream-engine's vLLM PUB socket and republishes the events on
Dynamo's event plane, where `dynamo_relay.py` (same discovery directory) picks them up.
LABEL is ours only (the engine's --worker-id, say): Dynamo names the worker by the
runtime's instance id (`endpoint.connection_id()`), printed in the `ready` line.

Why one runtime per engine: Dynamo's relay only activates a pool whose event sources are
workers with a model card; a publisher given an explicit `worker_id` that is not a card's
instance id is never activated (health `active_endpoint_count` stays 0). Several runtimes
in one process work; running this script once per engine works too.

Environment (set by the caller): DYN_FILE_KV=<shared discovery dir> (or, with
`--discovery etcd`, ETCD_ENDPOINTS=<url>), and every DYN_*_HOST
pinned to 127.0.0.1 with DYN_SELF_HOST_METADATA=0 (see benches/dynamo/README.md).
Optional: DYN_SYSTEM_PORT=<port below 32768> serves Prometheus metrics on /metrics.

Line protocol (stdout): `ready LABEL=DYNAMO_WORKER_ID ...` once every card is registered
and every publisher is up. Closing stdin shuts everything down.
"""

import argparse
import asyncio
import os
import sys
import tempfile

from dynamo._core import DistributedRuntime, ModelInput, ModelRuntimeConfig, ModelType, WorkerType
from dynamo.llm import KvEventPublisher, register_model

BLOCK = 16  # tokens per KV block (vLLM's default, and our engines')


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", default="bench.backend.generate")
    p.add_argument("--model", default="bench-model")
    p.add_argument("--total-kv-blocks", type=int, default=20_000)
    p.add_argument("--topic", default="kv-events", help="ZMQ topic the engines publish on")
    p.add_argument("--engine", action="append", required=True, metavar="LABEL=ENDPOINT")
    p.add_argument("--batching-timeout-ms", type=int, default=None)
    p.add_argument("--model-dir", default=None,
                   help="the model directory the cards name (default: a temporary one); "
                   "worker processes of one pool must share it")
    p.add_argument("--discovery", default="file", choices=["file", "etcd"],
                   help="Dynamo's discovery backend: file (DYN_FILE_KV) or etcd (ETCD_ENDPOINTS)")
    p.add_argument("--local-indexer", type=int, default=1,
                   help="enable the worker-local indexer (the relay's recovery queries it)")
    return p.parse_args()


async def main() -> None:
    args = parse_args()
    loop = asyncio.get_running_loop()

    # A minimal model directory (removed at exit): register_model wants a config.json to read.
    # The card names the model directory: workers of one pool in several processes must
    # share it (`--model-dir`), or Dynamo's relay sees cards that disagree and fences the
    # endpoint.
    model_tmp = None if args.model_dir else tempfile.TemporaryDirectory(prefix="dyn-bench-model-")
    model_dir = args.model_dir or model_tmp.name
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        f.write('{"model_type":"llama","max_position_embeddings":32768}')

    runtimes, publishers, ready = [], [], []
    for spec in args.engine:
        label, zmq_endpoint = spec.split("=", 1) if "=" in spec else (spec, spec)
        # One runtime per engine: its instance id is the worker id Dynamo's relay sees.
        runtime = DistributedRuntime(loop, args.discovery, "tcp", event_plane="zmq")
        # Only the first runtime serves DYN_SYSTEM_PORT (the others would fail to bind it);
        # its /metrics carries the counters of every publisher in the process.
        os.environ.pop("DYN_SYSTEM_PORT", None)
        endpoint = runtime.endpoint(args.endpoint)
        config = ModelRuntimeConfig()
        config.total_kv_blocks = args.total_kv_blocks
        config.enable_local_indexer = bool(args.local_indexer)
        await register_model(
            ModelInput.Tokens,
            ModelType.Chat | ModelType.Completions,
            endpoint,
            model_dir,
            args.model,
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=BLOCK,
            runtime_config=config,
        )
        publishers.append(KvEventPublisher(
            endpoint,
            kv_block_size=BLOCK,
            enable_local_indexer=bool(args.local_indexer),
            zmq_endpoint=zmq_endpoint,
            zmq_topic=args.topic,
            batching_timeout_ms=args.batching_timeout_ms,
        ))
        runtimes.append(runtime)
        ready.append(f"{label}={endpoint.connection_id()}")
    print(f"ready {' '.join(ready)}", flush=True)

    # Run until stdin closes.
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.readline():
        pass
    for publisher in publishers:
        publisher.shutdown()
    for runtime in runtimes:
        runtime.shutdown()
    if model_tmp:
        model_tmp.cleanup()


asyncio.run(main())
