"""A contract client written against our .proto only, as a Dynamo-side team would write it.

Usage: contract_client.py <relay host:port> <proto include dir> <out json>

Generates Python stubs from `dynamo/kvrelay/v1/relay.proto` with grpcio-tools, then:
GetRelayInfo; the first catalog; for every pool, SubscribeKvPool until its snapshot is
complete, rebuilding the filter's bucket words from the CBI1 payloads (and applying any
delta that follows the snapshot while reading); the first readiness update; the first load
window with every pool. Writes what it saw as JSON for the test to compare.
"""

import json
import os
import struct
import sys
import tempfile

from grpc_tools import protoc

MARKER = 0x4B565231


def generate(include: str, out: str) -> None:
    code = protoc.main([
        "protoc",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        os.path.join(include, "dynamo/kvrelay/v1/relay.proto"),
    ])
    if code != 0:
        raise SystemExit(f"protoc failed: {code}")


def apply_cbi1(words: list, payload: bytes, kind: str) -> None:
    """Applies one CBI1 payload (snapshot chunk or delta) to `words`."""
    assert payload[:4] == b"CBI1", payload[:4]
    version, frame_type = struct.unpack_from("<HH", payload, 4)
    assert version == 1
    body = payload[48:]
    if kind == "chunk":
        assert frame_type == 1
        _index, _count, offset = struct.unpack_from("<IIQ", body, 0)
        n = (len(body) - 16) // 8
        values = struct.unpack_from(f"<{n}Q", body, 16)
        words[offset:offset + n] = list(values)
    else:
        assert frame_type == 2
        _base, count = struct.unpack_from("<QI", body, 0)
        for at in range(count):
            bucket, word = struct.unpack_from("<IQ", body, 12 + 12 * at)
            words[bucket] = word


def main() -> None:
    addr, include, out_path = sys.argv[1:4]
    stubs = tempfile.mkdtemp()
    generate(include, stubs)
    sys.path.insert(0, stubs)
    import grpc
    from dynamo.kvrelay.v1 import relay_pb2 as pb
    from dynamo.kvrelay.v1 import relay_pb2_grpc as rpc

    options = [("grpc.max_receive_message_length", 8 * 1024 * 1024)]
    channel = grpc.insecure_channel(addr, options=options)
    relay = rpc.KvEventRelayStub(channel)
    seen = {}

    info = relay.GetRelayInfo(pb.RelayInfoRequest(contract_marker=MARKER), timeout=10)
    assert info.contract_marker == MARKER and info.protocol_version == 1
    seen["relay_incarnation"] = info.relay.relay_incarnation

    catalogs = relay.WatchKvPoolCatalog(
        pb.WatchKvPoolCatalogRequest(subscriber_id="python-client", contract_marker=MARKER),
        timeout=30,
    )
    catalog = next(catalogs)
    catalogs.cancel()
    seen["revision"] = catalog.revision
    seen["pools"] = []
    for pool in catalog.snapshot.pools:
        fmt = pool.producer.ckf_format
        words = [0] * fmt.bucket_count
        updates = relay.SubscribeKvPool(
            pb.SubscribeKvPoolRequest(
                subscriber_id="python-client",
                expected_producer=pool.producer,
                contract_marker=MARKER,
            ),
            timeout=30,
        )
        chunks = 0
        sequence = None
        for update in updates:
            assert update.contract_marker == MARKER
            assert update.producer == pool.producer
            if update.kind == pb.FILTER_UPDATE_KIND_SNAPSHOT_CHUNK:
                apply_cbi1(words, update.payload, "chunk")
                chunks += 1
                count = struct.unpack_from("<I", update.payload, 48 + 4)[0]
                sequence = update.sequence
                if chunks == count:
                    break
        updates.cancel()
        seen["pools"].append({
            "endpoint": f"{pool.serving_endpoint.namespace}/{pool.serving_endpoint.component}/{pool.serving_endpoint.endpoint}",
            "layout_generation": pool.producer.layout_generation,
            "dc_id": pool.producer.pool_id.dc_id,
            "sequence": sequence,
            "words": [f"{word:016x}" for word in words],
            "models": sorted(r.canonical_model_id for r in pool.registrations),
        })

    readiness = relay.SubscribeServingReadiness(
        pb.SubscribeServingReadinessRequest(subscriber_id="python-client", contract_marker=MARKER),
        timeout=30,
    )
    first = next(readiness)
    readiness.cancel()
    seen["ready_models"] = sorted(
        entry.canonical_model_id
        for entry in first.entries
        if entry.state == pb.SERVING_READINESS_STATE_READY
    )

    windows = relay.SubscribeKvPoolLoad(
        pb.SubscribeKvPoolLoadRequest(subscriber_id="python-client", contract_marker=MARKER),
        timeout=30,
    )
    for window in windows:
        if len(window.pools) == len(catalog.snapshot.pools):
            seen["load_pools"] = len(window.pools)
            break
    windows.cancel()

    with open(out_path, "w") as out:
        json.dump(seen, out)


main()
