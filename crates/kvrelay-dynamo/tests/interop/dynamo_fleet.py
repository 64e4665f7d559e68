"""Dynamo's relay and one Dynamo worker in one process (in-memory discovery), on loopback.

The worker registers `model-a` (aggregated, 16-token blocks, 1024 KV blocks) and publishes
KV events through Dynamo's own `KvEventPublisher`; the relay (`KvDcRelay`) serves them on
its gRPC door. Arguments: the model directory, then the gRPC door's loopback port (0: any free port).
Protocol with the test, one line each way:
- out `bound <host:port>` once the relay listens;
- in `store <first> <blocks>`: the worker stores `<blocks>` blocks whose tokens are
  `first, first + 1, ...` (16 per block) as one chained sequence; out `stored <first>`;
- in `remove <first> <blocks>`: the worker evicts that sequence's blocks; out `removed`;
- stdin closed: shut down.
Every address is loopback (DYN_*_HOST are set by the test).
"""

import asyncio
import sys

from dynamo._core import (
    DistributedRuntime,
    ModelInput,
    ModelRuntimeConfig,
    ModelType,
    WorkerType,
    register_model,
)
from dynamo.llm import KvDcRelay, KvEventPublisher

BLOCK = 16


def block_hashes(first: int, blocks: int) -> list[int]:
    # The engine's own block ids (signed i64): any distinct values.
    return [first * 1000 + at + 1 for at in range(blocks)]


async def main() -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp", event_plane="zmq")
    relay = KvDcRelay(
        runtime.endpoint("interop.relay.kv"),
        "dc-dynamo",
        namespaces=["interop"],
        expected_unique_blocks=4096,
        bind=f"127.0.0.1:{sys.argv[2] if len(sys.argv) > 2 else 0}",
    )
    await relay.start()
    endpoint = runtime.endpoint("interop.backend.generate")
    config = ModelRuntimeConfig()
    config.total_kv_blocks = 1024
    config.enable_local_indexer = True
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,
        endpoint,
        sys.argv[1],
        "model-a",
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=BLOCK,
        runtime_config=config,
    )
    publisher = KvEventPublisher(endpoint, kv_block_size=BLOCK, enable_local_indexer=True)
    health = await relay.health()
    print(f"bound {health['wan_bound_address']}", flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        command, first, blocks = line.split()
        first, blocks = int(first), int(blocks)
        if command == "store":
            tokens = list(range(first, first + BLOCK * blocks))
            publisher.publish_stored(tokens, [BLOCK] * blocks, block_hashes(first, blocks), None)
            print(f"stored {first}", flush=True)
        elif command == "remove":
            publisher.publish_removed(block_hashes(first, blocks))
            print("removed", flush=True)
    await relay.shutdown()


asyncio.run(main())
