"""Runs Dynamo's own relay (KvDcRelay from ai-dynamo-runtime) on loopback for interop tests.

Prints one line `bound <host:port>` once its gRPC door listens, then serves until stdin
closes (the test process holds it open), so the relay never outlives the test.
"""

import asyncio
import sys

from dynamo._core import DistributedRuntime
from dynamo.llm import KvDcRelay


async def main() -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("kvrelayinterop.relay.kv")
    relay = KvDcRelay(
        endpoint,
        "dc-dynamo",
        namespaces=["kvrelayinterop"],
        expected_unique_blocks=4096,
        bind="127.0.0.1:0",
    )
    await relay.start()
    health = await relay.health()
    print(f"bound {health['wan_bound_address']}", flush=True)
    # Serve until the test closes our stdin.
    await loop.run_in_executor(None, sys.stdin.read)
    await relay.shutdown()


asyncio.run(main())
