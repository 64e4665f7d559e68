"""Dynamo's KV DC relay (`KvDcRelay`) alone in its own process, for the bench.

Usage:
  dynamo_relay.py --dc dc-dynamo --expected-unique-blocks 1048576 --bind 127.0.0.1:0 \
      [--namespace bench] [--relay-endpoint bench.relay.kv] [--health-ms 1000] [--tuning K=V,...]

Discovery is Dynamo's "file" backend (the directory is DYN_FILE_KV) or, with
`--discovery etcd`, its etcd backend (ETCD_ENDPOINTS), shared with `dynamo_workers.py`.
The relay watches the pools (model cards) of `--namespace` and serves them on its gRPC
door (`dynamo.kvrelay.v1`) at `--bind`.

Line protocol (stdout):
  `bound HOST:PORT`         once the gRPC door listens;
  `health {json}`           every --health-ms (0: never) with `relay.health()`'s dict;
Closing stdin shuts the relay down cleanly (`relay.shutdown()`), then the process exits.
"""

import argparse
import asyncio
import json
import sys
import time

from dynamo._core import DistributedRuntime
from dynamo.llm import KvDcRelay


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dc", default="dc-dynamo")
    p.add_argument("--namespace", default="bench")
    p.add_argument("--relay-endpoint", default="bench.relay.kv")
    p.add_argument("--expected-unique-blocks", type=int, default=1_048_576)
    p.add_argument("--bind", default="127.0.0.1:0")
    p.add_argument("--health-ms", type=int, default=1000)
    p.add_argument("--discovery", default="file", choices=["file", "etcd"],
                   help="Dynamo's discovery backend: file (DYN_FILE_KV) or etcd (ETCD_ENDPOINTS)")
    p.add_argument("--tuning", default="",
                   help="KvDcRelay tuning, KEY=INT,... (e.g. publication_queue_capacity=4096); keys: "
                   "publication_threshold, publication_delay_ms, recovery_attempt_timeout_ms and the "
                   "gRPC config's (keepalive_interval_ms, keepalive_timeout_ms, pool_heartbeat_interval_ms, "
                   "readiness_heartbeat_interval_ms, snapshot_progress_timeout_ms, load_window_ms, "
                   "publication_queue_capacity, max_catalog_subscribers, max_pool_streams_total, ...)")
    return p.parse_args()


async def report_health(relay: KvDcRelay, every_ms: int) -> None:
    while True:
        await asyncio.sleep(every_ms / 1000)
        health = await relay.health()
        health["unix_ms"] = int(time.time() * 1000)
        print(f"health {json.dumps(health, default=str)}", flush=True)


async def main() -> None:
    args = parse_args()
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, args.discovery, "tcp", event_plane="zmq")
    relay = KvDcRelay(
        runtime.endpoint(args.relay_endpoint),
        args.dc,
        namespaces=[args.namespace],
        expected_unique_blocks=args.expected_unique_blocks,
        bind=args.bind,
        tuning={k: int(v) for k, v in (kv.split("=", 1) for kv in args.tuning.split(",") if kv)} or None,
    )
    await relay.start()
    health = await relay.health()
    print(f"bound {health['wan_bound_address']}", flush=True)
    reporter = asyncio.create_task(report_health(relay, args.health_ms)) if args.health_ms > 0 else None

    # Run until stdin closes.
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.readline():
        pass
    if reporter:
        reporter.cancel()
    await relay.shutdown()
    runtime.shutdown()


asyncio.run(main())
