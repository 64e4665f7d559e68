//! Events admitted → delta delivered: throughput (blocks/s) and latency of one 16-event
//! batch through the pool actor and its publication hub to 1, 8 and 64 subscribers.
//!
//! Baselines measured in the same run: `baseline-no-subscriber` (the actor applies and
//! publishes with no hub attached; the batch ends at the actor's flush reply) and
//! `baseline-mpsc-hop` (16 messages through a bare tokio mpsc to a task that replies).
//! p50/p99 of the per-batch latency are printed to stderr after each case. Every case is
//! driven from a task on the runtime's workers (see `on_worker`).
//!
//! `snapshot-copy` measures the table copy the actor makes inline when a hub attaches, with
//! a bare memcpy of the same table as its baseline.

#![allow(missing_docs, reason = "criterion macros generate undocumented items")]
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    reason = "benchmark setup; a lost delta fails the run loudly"
)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_ckf::{
    CkfConfig, EventPayload, PoolFilter, RemovedBlocks, RouterEvent, SourceId, StoredBlock,
    StoredBlocks,
};
use kvrelay_identity::{
    CanonicalModelId, CanonicalModelRegistration, DcId, DcRelayIdentity, EndpointId,
    IndexerIdentitySpec, KvQueryHashFormat, KvQuerySemantics, PoolId, WorkerRole,
    resolve_indexer_domain,
};
use kvrelay_pool::{
    AttachRequest, Limits, PoolAttachment, PoolFrameKind, PoolRegistry, RegistryConfig,
};
use tokio::sync::{Notify, mpsc, oneshot};

const BATCH: u64 = 16;

struct Fixture {
    registry: PoolRegistry,
    attachment: PoolAttachment,
    delivered: Vec<Arc<AtomicU64>>,
    notify: Arc<Notify>,
    iteration: u64,
    sequence: u64,
}

fn attach_request() -> AttachRequest {
    let semantics = KvQuerySemantics::new(16, KvQueryHashFormat::DynamoStandardV1).unwrap();
    let endpoint: EndpointId = "bench.backend.generate".parse().unwrap();
    let domain = resolve_indexer_domain(
        "bench/model",
        &IndexerIdentitySpec::default(),
        semantics,
        &endpoint,
    );
    AttachRequest {
        pool: PoolId {
            indexer_domain: domain,
            dc_id: DcId::from_dc_name("bench"),
        },
        endpoint,
        registrations: vec![CanonicalModelRegistration::base(
            CanonicalModelId::new("model").unwrap(),
            vec![],
        )],
        query_semantics: semantics,
        roles: vec![WorkerRole::Aggregated],
        expected_unique_blocks: 1 << 20,
        filter_density: kvrelay_ckf::FilterDensity::V1,
        load_capacity: None,
        tier_lanes: Vec::new(),
    }
}

async fn fixture(subscribers: usize) -> Fixture {
    let registry = PoolRegistry::new(RegistryConfig {
        relay: DcRelayIdentity::new(1, 2),
        limits: Limits {
            // The bench flushes each batch itself (`one_batch`): no window or size bound
            // interferes. A window this long also means a batch that is not flushed is never
            // published, so a missing flush shows up as the deadline in `wait_delivered`.
            publication_window: Duration::from_secs(3600),
            max_delta_buckets: u32::MAX,
            ..Limits::default()
        },
    })
    .unwrap();
    let attachment = registry.attach(attach_request()).await.unwrap();
    let notify = Arc::new(Notify::new());
    let mut delivered = Vec::new();
    for _ in 0..subscribers {
        let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
        let sequence = Arc::new(AtomicU64::new(0));
        delivered.push(sequence.clone());
        let notify = notify.clone();
        tokio::spawn(async move {
            while let Ok(frame) = subscription.next_frame().await {
                if frame.kind != PoolFrameKind::Heartbeat {
                    sequence.store(frame.sequence, Ordering::Release);
                    notify.notify_one();
                }
            }
        });
    }
    // Wait until every subscriber installed its snapshot.
    let base = attachment.actor.stats().await.unwrap().sequence;
    wait_delivered(&delivered, &notify, base).await;
    Fixture {
        registry,
        attachment,
        delivered,
        notify,
        iteration: 0,
        sequence: base,
    }
}

/// How long a batch may take to reach every subscriber before the bench gives up: far
/// above any real latency, so only a lost delta (a bench or publication bug) trips it,
/// and the run fails with a message instead of hanging until the CI job is killed.
const DELIVERY_DEADLINE: Duration = Duration::from_secs(30);

async fn wait_delivered(delivered: &[Arc<AtomicU64>], notify: &Notify, target: u64) {
    let deadline = tokio::time::Instant::now() + DELIVERY_DEADLINE;
    loop {
        let notified = notify.notified();
        if delivered
            .iter()
            .all(|sequence| sequence.load(Ordering::Acquire) >= target)
        {
            return;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            let behind: Vec<u64> = delivered
                .iter()
                .map(|sequence| sequence.load(Ordering::Acquire))
                .collect();
            panic!(
                "publication bench: sequence {target} not delivered within {DELIVERY_DEADLINE:?} \
                 (subscribers at {behind:?})"
            );
        }
    }
}

/// One batch: 16 one-block events that either store 16 new blocks or remove the previous
/// batch's, so the filter stays at a steady load; returns when every subscriber (or, with
/// none, the actor) has the resulting delta.
async fn one_batch(fixture: &mut Fixture) {
    let iteration = fixture.iteration;
    fixture.iteration += 1;
    let source = SourceId::new(1, 0);
    let first_id = (iteration / 2) * BATCH;
    // Every batch changes buckets, so it yields exactly one delta.
    fixture.sequence += 1;
    let target = fixture.sequence;
    let start = Instant::now();
    for k in 0..BATCH {
        let id = first_id + k;
        let payload = if iteration.is_multiple_of(2) {
            EventPayload::Stored(StoredBlocks {
                parent_engine_block_id: None,
                blocks: vec![StoredBlock {
                    engine_block_id: id,
                    token_hash: id.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                }],
            })
        } else {
            EventPayload::Removed(RemovedBlocks {
                engine_block_ids: vec![id],
            })
        };
        fixture
            .attachment
            .actor
            .submit(RouterEvent {
                source,
                event_id: iteration * BATCH + k,
                payload,
            })
            .await
            .unwrap();
    }
    // The flush publishes the batch as one delta (the window never would, see `fixture`);
    // with subscribers the batch ends when each of them has it.
    fixture.attachment.actor.flush().await.unwrap();
    if !fixture.delivered.is_empty() {
        wait_delivered(&fixture.delivered, &fixture.notify, target).await;
    }
    record(start.elapsed());
}

/// Per-batch latencies of the current case (recorded on whichever worker ran the batch).
static SAMPLES: Mutex<Vec<Duration>> = Mutex::new(Vec::new());

fn record(elapsed: Duration) {
    SAMPLES.lock().unwrap().push(elapsed);
}

/// Runs `future` as a task on `runtime`'s workers, as the relay's ingest tasks run.
///
/// Driving the batches from `block_on` instead (the calling thread, outside the worker
/// pool) makes every submit and delivery a cross-thread wake-up of a parked worker; on a
/// loaded 2-core host that wake-up latency dominated and inverted the cases (1 subscriber
/// measured slower than 8).
fn on_worker<T: Send + 'static>(
    runtime: &tokio::runtime::Runtime,
    future: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    runtime.block_on(runtime.spawn(future)).unwrap()
}

fn report(case: &str) {
    let mut samples = std::mem::take(&mut *SAMPLES.lock().unwrap());
    if samples.is_empty() {
        return;
    }
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    eprintln!(
        "{case}: batches {} p50 {:?} p99 {:?}",
        samples.len(),
        at(0.5),
        at(0.99)
    );
}

fn bench_publication(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("publication");
    group.throughput(Throughput::Elements(BATCH));

    group.bench_function("baseline-mpsc-hop", |b| {
        let (tx, mut rx) =
            runtime.block_on(async { mpsc::channel::<(u64, Option<oneshot::Sender<()>>)>(256) });
        runtime.spawn(async move {
            while let Some((_, reply)) = rx.recv().await {
                if let Some(reply) = reply {
                    let _ = reply.send(());
                }
            }
        });
        b.iter_custom(|iters| {
            let tx = tx.clone();
            on_worker(&runtime, async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let started = Instant::now();
                    for k in 0..BATCH - 1 {
                        tx.send((k, None)).await.unwrap();
                    }
                    let (reply, done) = oneshot::channel();
                    tx.send((BATCH, Some(reply))).await.unwrap();
                    done.await.unwrap();
                    record(started.elapsed());
                }
                start.elapsed()
            })
        });
    });
    report("publication/baseline-mpsc-hop");

    for subscribers in [0usize, 1, 8, 64] {
        let name = if subscribers == 0 {
            "baseline-no-subscriber".to_owned()
        } else {
            format!("subscribers-{subscribers}")
        };
        let mut fixture = Some(runtime.block_on(fixture(subscribers)));
        group.bench_function(name.as_str(), |b| {
            b.iter_custom(|iters| {
                let mut owned = fixture.take().unwrap();
                let (owned, elapsed) = on_worker(&runtime, async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        one_batch(&mut owned).await;
                    }
                    (owned, start.elapsed())
                });
                fixture = Some(owned);
                elapsed
            });
        });
        report(&format!("publication/{name}"));
        runtime.block_on(async move {
            let Fixture {
                registry,
                attachment,
                ..
            } = fixture.unwrap();
            registry.detach(attachment).await;
            registry.shutdown().await;
        });
    }
    group.finish();
}

/// What the actor does inline when a hub attaches (the stall item of a hub start or
/// resynchronisation): a fallibly allocated copy of the whole table, at the bench's filter
/// size. Baseline: a bare memcpy of the same table into a buffer allocated once.
fn bench_snapshot_copy(c: &mut Criterion) {
    let filter = PoolFilter::new(CkfConfig::new(attach_request().expected_unique_blocks)).unwrap();
    let words = filter.words();
    let bytes = std::mem::size_of_val(words) as u64;
    eprintln!(
        "snapshot-copy: table of {} buckets, {bytes} bytes",
        words.len()
    );
    let mut group = c.benchmark_group("snapshot-copy");
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("actor-table-copy", |b| {
        b.iter(|| {
            let mut copy = Vec::new();
            copy.try_reserve_exact(words.len()).unwrap();
            copy.extend_from_slice(words);
            copy
        });
    });
    let mut buffer = vec![0u64; words.len()];
    group.bench_function("baseline-memcpy", |b| {
        b.iter(|| buffer.copy_from_slice(std::hint::black_box(words)));
    });
    group.finish();
}

criterion_group!(benches, bench_publication, bench_snapshot_copy);
criterion_main!(benches);
